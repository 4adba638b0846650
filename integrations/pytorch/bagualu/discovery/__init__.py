"""Model discovery: the layers and operators of a model (unmodified nn.Module or OpBlock layers)
and their classification into the planner's operator kinds."""

// libFuzzer target: model files in JSON (bgl-plan --model M.json, the daemon's model files).
// LoadModelConfig is the entry point; a model it accepts is then built into the stage's operator
// graph (BuildStageGraph on the model's GPU profile), which reads the optional layer_graph. An
// error Status is a clean refusal; a crash, a sanitizer report or an exception is a finding.
#include <cstddef>
#include <cstdint>

#include "fuzz/fuzz_util.h"
#include "fuzz/model_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const bgl::fuzz::ScratchRemover remover(bgl::fuzz::ScratchPath(".json"));
  bgl::fuzz::WriteInput(remover.path, data, size);
  bgl::fuzz::CheckModelFile(remover.path);
  return 0;
}

"""A clean run ends quietly: no nanobind leak report ('leaked N instances ... triton') on stderr.

The report came from instrument()'s gc.freeze(): frozen objects are never collected, not even
when the interpreter exits, so the nanobind objects of triton (imported by torch._dynamo, which
torch.utils.checkpoint, transformers and torch.distributed.pipelining import) were still alive
when nanobind checked at exit. Each case runs in its own interpreter, as a user's script does."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import require_libs

ROOT = Path(__file__).resolve().parents[2]

# A plain nn.Module with repeated blocks (one of them under torch.utils.checkpoint), trained for
# one step through bagualu's public API, then installed and instrumented again (as a test suite
# or a second model does), and left to exit.
SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from torch import nn
    from torch.utils.checkpoint import checkpoint
    if {dynamo_first}:
        import torch._dynamo  # what transformers and torch.compile users import first

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(x)))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Block() for _ in range(3)])

        def forward(self, x):
            x = checkpoint(self.layers[0], x, use_reentrant=False)
            for layer in self.layers[1:]:
                x = layer(x)
            return x

    def step(model, x):
        loss = model(x).square().mean()
        loss.backward()

    torch.manual_seed(0)
    x = torch.randn(4, 16)
    if {with_bagualu}:
        import bagualu
        for _ in range(2):
            model = Model()
            bagualu.install(capacity="64MiB", governor="none", device="cpu",
                            log_iterations=False)
            bagualu.instrument(model)
            bagualu.begin_iteration()
            bagualu.step_point("steady", 0, None)
            with bagualu.forward(0):
                loss = model(x).square().mean()
            with bagualu.backward(0):
                loss.backward()
            bagualu.end_iteration()
        if {uninstall}:
            bagualu.uninstall()
    else:
        step(Model(), x)
    print("done")
""")


def _run(**flags: bool) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "integrations" / "pytorch")] + env.get("PYTHONPATH", "").split(os.pathsep))
    code = SCRIPT.format(**{k: repr(v) for k, v in flags.items()})
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)


def _leak_lines(stderr: str) -> list:
    return [line for line in stderr.splitlines() if "nanobind" in line or "leaked" in line]


@pytest.mark.parametrize("dynamo_first", [False, True])
def test_plain_torch_exits_quietly(dynamo_first: bool) -> None:
    """The control: the same script without bagualu prints no leak report."""
    out = _run(with_bagualu=False, dynamo_first=dynamo_first, uninstall=False)
    assert out.returncode == 0 and "done" in out.stdout, out.stderr[-3000:]
    assert _leak_lines(out.stderr) == [], out.stderr[-3000:]


@pytest.mark.parametrize("dynamo_first", [False, True])
@pytest.mark.parametrize("uninstall", [False, True])
def test_a_bagualu_run_exits_quietly(dynamo_first: bool, uninstall: bool) -> None:
    require_libs()
    out = _run(with_bagualu=True, dynamo_first=dynamo_first, uninstall=uninstall)
    assert out.returncode == 0 and "done" in out.stdout, out.stderr[-3000:]
    assert _leak_lines(out.stderr) == [], "\n".join(_leak_lines(out.stderr)[:5])

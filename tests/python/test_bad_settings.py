"""Bad input to the package's own parsers (issue 45 item 1): every ``--bagualu.*`` key of the
torchtitan trainer and every BGL_* variable the Python package reads, each malformed, out of
range or unknown (at any depth of the torchtitan flags), refused with an error that names it.
The native parsers (BGL_ALLOC_CONF, sizes, model and calibration files) have libFuzzer targets
(docs/operations.md, "Fuzzing"). The torchtitan cases run in one process of .venv-torchtitan
(about 10-25 s, torchtitan's import); the rest in-process, well under a second."""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from typing import Any, Dict, List, Tuple

import pytest
import torch

import bagualu
from bagualu import runtime, settings
from bagualu.errors import LibraryNotFound
from bagualu.native import libs
from bagualu.planning import calibration as calibrations
from bagualu.planning.governor import search_options, warm_up_options
from conftest import ROOT, require_libs

GOOD_SIZE = "1MiB"


# -- settings (install's arguments) ---------------------------------------------------------
@pytest.mark.parametrize("value", ["12XB", "1G", "", "MiB", "-1MiB", "1e400GiB", "0x10", "nan",
                                   "1.5.2KiB", "12 MiB extra", True, -5, math.nan, math.inf,
                                   -1.0, [1], None])
def test_a_bad_size_is_refused_naming_what(value: Any) -> None:
    require_libs()
    with pytest.raises(ValueError, match=r"^pinned_capacity: "):
        settings.parse_size(value, "pinned_capacity")


@pytest.mark.parametrize("key,value,match", [
    ("capacity", "lots", r"^capacity: 'lots' is not a size"),
    ("pinned_capacity", "-3GiB", r"^pinned_capacity: "),
    ("policy", "fast", r"unknown policy 'fast' \(known: keep-all, static-under"),
    ("issue_order", "random", r"unknown issue_order 'random' \(known: dual-batch, serial\)"),
    ("compiled_operators", "all", r"unknown compiled_operators 'all' \(known: operators, block"),
    ("compiled_recompute", "experts", r"^compiled_recompute: 'experts' is neither None, 'auto'"),
    ("compiled_recompute", [[]], r"^compiled_recompute: group \[\] is not a non-empty list"),
    ("min_load_factor", 0.5, r"^min_load_factor: 0.5 is not a load factor in \[1, 64\]"),
    ("min_load_factor", "2", r"^min_load_factor: '2' is not a load factor"),
    ("min_load_factor", math.nan, r"^min_load_factor: nan is not a load factor"),
    ("min_load_factor", True, r"^min_load_factor: True is not a load factor"),
    ("min_load_factor", 2.0, r"^min_load_factor applies to policy 'bagualu' .* not to 'keep-all'"),
    ("governor", "unix://", r"^governor: 'unix://' names no socket path"),
    ("governor", "unix:///run/x.sock extra", r"^governor: .* has spaces or control characters"),
    ("governor", "host:1\x00", r"^governor: .* has spaces or control characters"),
])
def test_install_refuses_a_bad_argument_naming_it(key: str, value: str, match: str) -> None:
    require_libs()
    args: Dict[str, Any] = {"capacity": GOOD_SIZE, "device": "cpu", "governor": "none",
                            "policy": "keep-all", key: value}
    with pytest.raises(ValueError, match=match):
        bagualu.install(**args)
    assert runtime.active() is None


# -- the environment ----------------------------------------------------------------------
@pytest.mark.parametrize("value,match", [
    ("unix://", r"^BGL_GOVERNOR: 'unix://' names no socket path"),
    ("unix:", r"^BGL_GOVERNOR: 'unix:' names no socket path"),
    ("host :7787", r"^BGL_GOVERNOR: .* has spaces or control characters"),
    ("unix:///run/bagualu/governor.sock\n", r"^BGL_GOVERNOR: .* spaces or control characters"),
])
def test_a_bad_governor_variable_is_refused_naming_it(monkeypatch, value: str,
                                                      match: str) -> None:
    require_libs()
    monkeypatch.setenv("BGL_GOVERNOR", value)
    with pytest.raises(ValueError, match=match):
        bagualu.install(capacity=GOOD_SIZE, device="cpu", policy="keep-all")
    assert runtime.active() is None


@pytest.mark.parametrize("value", ["unix:///run/bagualu/governor.sock", "127.0.0.1:7787",
                                   "dns:///node:7787", "none", "NONE", "embedded", "off", ""])
def test_good_governor_addresses_pass(value: str) -> None:
    assert settings.check_governor_address(value, "BGL_GOVERNOR") == value


@pytest.mark.parametrize("name,value,match", [
    ("BGL_WARM_SPIKE_BOUND", "abc", r"^BGL_WARM_SPIKE_BOUND: .*\[1, 64\], got 'abc'"),
    ("BGL_WARM_SPIKE_BOUND", "0.5", r"^BGL_WARM_SPIKE_BOUND: .*got '0.5'"),
    ("BGL_WARM_SPIKE_BOUND", "65", r"^BGL_WARM_SPIKE_BOUND: .*got '65'"),
    ("BGL_WARM_SPIKE_BOUND", "nan", r"^BGL_WARM_SPIKE_BOUND: .*got 'nan'"),
    ("BGL_WARM_SPIKE_BOUND", "inf", r"^BGL_WARM_SPIKE_BOUND: .*got 'inf'"),
    ("BGL_WARM_NICE", "-1", r"^BGL_WARM_NICE: .*\[0, 19\], got '-1'"),
    ("BGL_WARM_NICE", "20", r"^BGL_WARM_NICE: .*got '20'"),
    ("BGL_WARM_NICE", "x", r"^BGL_WARM_NICE: .*got 'x'"),
    ("BGL_WARM_NICE", "1.5", r"^BGL_WARM_NICE: .*got '1.5'"),
])
def test_a_bad_warm_up_variable_is_refused_naming_it(name: str, value: str, match: str) -> None:
    for warm in ("1", "0"):  # refused whether the warm-up is on or not
        with pytest.raises(ValueError, match=match):
            warm_up_options({"BGL_WARM_UP": warm, name: value})


@pytest.mark.parametrize("value", ["2", "maybe", "-1"])
def test_a_bad_reproducible_plans_value_is_refused_naming_it(value: str) -> None:
    with pytest.raises(ValueError, match=r"^BGL_REPRODUCIBLE_PLANS: must be 1/true/on/yes .*"
                                         r"got '"):
        search_options({"BGL_REPRODUCIBLE_PLANS": value})
    assert search_options({})["anytime_min_ops"] == 1
    assert search_options({"BGL_REPRODUCIBLE_PLANS": "on"}) == {"anytime_min_ops": 0,
                                                               "gate_search_share": 0.0}


@pytest.mark.parametrize("content,match", [
    (None, r"^BGL_CALIBRATION: calibration file .*: not found"),
    ("{not json", r"^BGL_CALIBRATION: calibration file .*: not valid JSON"),
    ("[1, 2]", r"^BGL_CALIBRATION: calibration file .*: the top level must be an object"),
    ('{"rooflines": {"offload": {"peak_GBps": -1}}}', r"^BGL_CALIBRATION: calibration file "),
    ('{"no_such_field": 1}', r"^BGL_CALIBRATION: calibration file .*no_such_field"),
])
def test_a_bad_calibration_variable_is_refused_naming_it(monkeypatch, tmp_path,
                                                         content: Any, match: str) -> None:
    path = tmp_path / "cal.json"
    if content is not None:
        path.write_text(content)
    monkeypatch.setenv("BGL_CALIBRATION", str(path))

    def no_measurement(**_: Any) -> Any:
        raise AssertionError("a named calibration must not be measured")
    with pytest.raises(calibrations.CalibrationError, match=match):
        calibrations.for_machine(torch.device("cpu"), no_measurement, 1 << 20)


def test_an_enforce_lib_variable_that_is_no_file_is_refused_naming_it(monkeypatch,
                                                                       tmp_path) -> None:
    from bagualu.native import alloc
    alloc.load()
    monkeypatch.setattr(alloc, "_enforce_lib", None)  # loaded once per process: ask again
    for value in (str(tmp_path / "missing.so"), str(tmp_path)):
        monkeypatch.setenv("BGL_ENFORCE_LIB", value)
        with pytest.raises(LibraryNotFound, match=r"^BGL_ENFORCE_LIB: '.*' is not a file"):
            alloc.load_enforce()


def test_a_lib_dir_variable_that_does_not_exist_is_refused_naming_it(monkeypatch,
                                                                      tmp_path) -> None:
    missing = tmp_path / "no-such-build"
    monkeypatch.setenv("BGL_LIB_DIR", str(missing))
    with pytest.raises(LibraryNotFound, match=r"^BGL_LIB_DIR: '.*no-such-build' does not exist"):
        libs.find_file("libbgl_alloc.so")




@pytest.mark.parametrize("value,match", [
    ("x" * 257, r"^BGL_JOB_ID: 257 bytes, over the daemon's limit of 256"),
    ("job\x01", r"^BGL_JOB_ID: .* must be printable ASCII"),
    ("jöb", r"^BGL_JOB_ID: .* must be printable ASCII"),
])
def test_a_bad_job_id_variable_is_refused_naming_it(monkeypatch, value: str, match: str) -> None:
    # The daemon would refuse it at registration and the process would plan in-process.
    from bagualu.planning.governor import Governor
    monkeypatch.setenv("BGL_JOB_ID", value)
    with pytest.raises(ValueError, match=match):
        Governor("none")
    monkeypatch.setenv("BGL_JOB_ID", "torchrun-1234:rank 0")
    assert Governor("none").job_id == "torchrun-1234:rank 0"
    monkeypatch.setenv("BGL_JOB_ID", "")  # empty: the default
    assert Governor("none").job_id == f"pid-{os.getpid()}"
    with pytest.raises(ValueError, match=r"^job_id: .* must be printable ASCII"):
        Governor("none", job_id="a\tb")


def test_a_cache_dir_variable_naming_a_file_is_refused_naming_it(monkeypatch, tmp_path) -> None:
    a_file = tmp_path / "cache"
    a_file.write_text("not a folder")
    monkeypatch.setenv("BGL_CACHE_DIR", str(a_file))
    with pytest.raises(ValueError, match=r"^BGL_CACHE_DIR: '.*cache' exists and is not a dir"):
        settings.cache_dir()

    def no_measurement(**_: Any) -> Any:
        raise AssertionError("nothing is measured before the cache is found")
    with pytest.raises(ValueError, match=r"^BGL_CACHE_DIR: "):
        calibrations.for_machine(torch.device("cpu"), no_measurement, 1 << 20)
    monkeypatch.setenv("BGL_CACHE_DIR", "")  # empty: the default, not the working directory
    assert settings.cache_dir() == settings.Path.home() / ".cache" / "bagualu"
    monkeypatch.setenv("BGL_CACHE_DIR", "rel/cache")  # relative: against the working directory
    assert settings.cache_dir() == settings.Path.cwd() / "rel" / "cache"


ENFORCER_START = """
import torch
from bagualu.enforce.enforcer import Enforcer
try:
    Enforcer(torch.device("cpu"), 1 << 20, borrowed_free_is_safe=False).close()
    print("started")
except Exception as e:
    print(type(e).__name__ + ":", e)
print("still running")
"""


@pytest.mark.parametrize("name,value,match", [
    ("BGL_WAIT_TIMEOUT_MS", "abc", r"BGL_WAIT_TIMEOUT_MS: 'abc' is not a positive whole number"),
    ("BGL_WAIT_TIMEOUT_MS", "0", r"BGL_WAIT_TIMEOUT_MS: '0' is not a positive whole number"),
    ("BGL_WAIT_TIMEOUT_MS", "99999999999999999999", r"BGL_WAIT_TIMEOUT_MS: '9+' is not a"),
    ("BGL_FAULT_STALL_MS", "-3", r"BGL_FAULT_STALL_MS: '-3' is not a positive whole number"),
    ("BGL_FAULT", "bogus:1", r"BGL_FAULT: fault 'bogus:1': unknown kind 'bogus'"),
])
def test_a_bad_native_wait_or_fault_variable_stops_the_enforcer_naming_it(
        name: str, value: str, match: str) -> None:
    # Read once per process by the native library (allocator/detail/fault.cc): a process each.
    # It was printed as "ignoring" and training went on with the default (a 60 s wait bound).
    require_libs()
    env = dict(os.environ, **{name: value})
    out = subprocess.run([sys.executable, "-c", ENFORCER_START], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[-1] == "still running", out.stdout
    assert lines[0].startswith("BagualuError: enforcer create: bgl_enf_create: "), out.stdout
    assert re.search(match, lines[0]), lines[0]
    assert re.search(match, out.stderr), out.stderr  # said once on stderr too (preloaded use)


def test_good_native_wait_and_fault_variables_start_the_enforcer() -> None:
    require_libs()
    env = dict(os.environ, BGL_WAIT_TIMEOUT_MS="500", BGL_FAULT_STALL_MS="20", BGL_FAULT="count")
    out = subprocess.run([sys.executable, "-c", ENFORCER_START], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.stdout.splitlines() == ["started", "still running"], out.stdout + out.stderr
    assert "BGL_" not in out.stderr, out.stderr

# -- torchtitan's [bagualu] section (.venv-torchtitan) --------------------------------------
TORCHTITAN_PARSE = r"""
import contextlib, io, json, sys
from torchtitan.config.manager import ConfigManager
from bagualu.loops import torchtitan as tt
out = []
for args in json.loads(sys.argv[1]):
    text = io.StringIO()
    try:
        with contextlib.redirect_stderr(text), contextlib.redirect_stdout(text):
            config = ConfigManager().parse_args(
                ["--module", "bagualu.torchtitan", "--config", "deepseek_v3_debugmodel", *args])
        tt.check_config(config.bagualu)
        out.append(["ok", ""])
    except SystemExit as e:
        out.append([f"exit {e.code}", text.getvalue()])
    except Exception as e:
        out.append([type(e).__name__, str(e)])
print("RESULTS " + json.dumps(out))
"""
CAP = ["--bagualu.capacity", GOOD_SIZE]
OPS = ["--bagualu.compiled-operators", "operators"]
# (flags, the outcome: "ok", an exception's name or tyro's "exit 2", a regex of its message)
TORCHTITAN_CASES: List[Tuple[List[str], str, str]] = [
    (CAP, "ok", ""),
    (CAP + ["--bagualu.policy", "static-under", "--bagualu.governor", "none",
            "--bagualu.issue-order", "serial", "--bagualu.no-allow-fp8",
            "--bagualu.no-log-iterations", "--bagualu.compiled-operators", "operators"], "ok", ""),
    ([], "ValueError", r"^--bagualu\.capacity: required"),
    (["--bagualu.capacity", "12XB"], "ValueError", r"^--bagualu\.capacity: '12XB' is not a size"),
    (["--bagualu.capacity", "-1MiB"], "ValueError", r"^--bagualu\.capacity: "),
    (["--bagualu.capacity", "0"], "ValueError", r"^--bagualu\.capacity: must be above 0"),
    (CAP + ["--bagualu.policy", "fast"], "PolicyError",
     r"^--bagualu\.policy: unknown policy 'fast' \(known: "),
    (CAP + ["--bagualu.issue-order", "random"], "PolicyError",
     r"^--bagualu\.issue_order: unknown issue_order 'random'"),
    (CAP + ["--bagualu.compiled-operators", "all"], "PolicyError",
     r"^--bagualu\.compiled_operators: unknown compiled_operators 'all'"),
    (CAP + OPS + ["--bagualu.compiled-recompute", "auto"], "ok", ""),
    (CAP + OPS + ["--bagualu.compiled-recompute", "None"], "ok", ""),
    (CAP + OPS + ["--bagualu.compiled-recompute", "moe.experts,attention.wq+attention.wo"],
     "ok", ""),
    (CAP + ["--bagualu.compiled-recompute", "auto"], "PolicyError",
     r"^--bagualu\.compiled_recompute: 'auto' needs --bagualu\.compiled_operators operators "
     r"\(it is 'block'"),
    (CAP + OPS + ["--bagualu.compiled-recompute", "a,,b"], "PolicyError",
     r"^--bagualu\.compiled_recompute: 'a,,b' is neither None, 'auto' nor groups"),
    (CAP + OPS + ["--bagualu.compiled-recompute", "a+"], "PolicyError",
     r"^--bagualu\.compiled_recompute: 'a\+' is neither"),
    (CAP + OPS + ["--bagualu.compiled-recompute", "a, b"], "PolicyError",
     r"^--bagualu\.compiled_recompute: 'a, b' is neither"),
    (CAP + OPS + ["--bagualu.compiled-recompute", ""], "PolicyError",
     r"^--bagualu\.compiled_recompute: '' is neither"),
    (CAP + ["--bagualu.min-load-factor", "2.5"], "ok", ""),
    (CAP + ["--bagualu.min-load-factor", "0.5"], "PolicyError",
     r"^--bagualu\.min_load_factor: 0\.5 is not a load factor in \[1, 64\]"),
    (CAP + ["--bagualu.min-load-factor", "2", "--bagualu.policy", "keep-all"], "PolicyError",
     r"^--bagualu\.min_load_factor applies to policy 'bagualu'"),
    (CAP + ["--bagualu.min-load-factor", "x"], "exit 2", r"min-load-factor"),
    (CAP + ["--bagualu.governor", "unix://"], "ValueError",
     r"^--bagualu\.governor: 'unix://' names no socket path"),
    (CAP + ["--bagualu.governor", "a b"], "ValueError",
     r"^--bagualu\.governor: 'a b' has spaces"),
    # tyro refuses these (exit 2), naming the flag or the value it could not place.
    (CAP + ["--bagualu.allow-fp8", "maybe"], "exit 2", r"Unrecognized options: maybe"),
    (CAP + ["--bagualu.log-iterations=no"], "exit 2", r"Unrecognized options: no"),
    (CAP + ["--bagualu.capacityy", "1"], "exit 2", r"--bagualu\.capacityy"),
    (CAP + ["--bagualu.capacity.unit", "1"], "exit 2", r"--bagualu\.capacity\.unit"),
    (CAP + ["--bagualu.policy.name", "x"], "exit 2", r"--bagualu\.policy\.name"),
    (CAP + ["--bagualux.capacity", "1"], "exit 2", r"--bagualux\.capacity"),
    (CAP + ["--bagualu"], "exit 2", r"--bagualu"),
]


@pytest.fixture(scope="module")
def torchtitan_results() -> List[Tuple[str, str]]:
    require_libs()
    from test_torchtitan import python  # skips where .venv-torchtitan sits on another torch
    env = dict(os.environ, PYTHONPATH=str(ROOT / "integrations" / "pytorch"),
               COLUMNS="200")
    out = subprocess.run([str(python()), "-c", TORCHTITAN_PARSE,
                          json.dumps([c[0] for c in TORCHTITAN_CASES])],
                         env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULTS ")), None)
    assert line is not None, out.stdout[-2000:] + out.stderr[-2000:]
    return [tuple(r) for r in json.loads(line[len("RESULTS "):])]


@pytest.mark.parametrize("case", range(len(TORCHTITAN_CASES)),
                         ids=[" ".join(c[0][2:] if c[0][:2] == CAP else c[0]) or "(none)"
                              for c in TORCHTITAN_CASES])
def test_torchtitan_bagualu_flags_refused_naming_the_flag(torchtitan_results, case: int) -> None:
    flags, outcome, match = TORCHTITAN_CASES[case]
    got, message = torchtitan_results[case]
    assert got == outcome, (flags, got, message[-1500:])
    if match:
        assert re.search(match, message), (flags, message[-1500:])

"""bagualu._C, the compiled binding (native/ext.py, integrations/pytorch/csrc): it is what the
package loads, it owns torch.ops.bagualu, it refuses a torch it was not built for by name, and
bad input at its calls is an error that leaves the process and the enforcer's data as they were."""
from __future__ import annotations

import gc
import shutil

import pytest
import torch

from bagualu.enforce.enforcer import Enforcer
from bagualu.errors import BagualuError, LibraryNotFound
from bagualu.native import ext, libs


def test_the_package_loads_the_binding_built_for_this_torch() -> None:
    m = ext.load()
    assert m.torch_version == torch.__version__
    assert m.abi_version == ext.ABI_VERSION
    assert torch.ops.bagualu.abi_version() == ext.ABI_VERSION
    enf = Enforcer(torch.device("cpu"), 1 << 20, borrowed_free_is_safe=False)
    assert isinstance(enf.fast, m.Enforcer)  # the hot calls go through it, not ctypes
    enf.close()


def test_the_binding_owns_the_torch_ops_namespace() -> None:
    ext.load()
    with pytest.raises(RuntimeError, match="bagualu"):
        torch.library.Library("bagualu", "DEF")  # a second definer of the namespace


def test_a_binding_built_for_another_torch_is_refused_naming_both(tmp_path,
                                                                    monkeypatch) -> None:
    found = ext._candidates()
    assert found, "the build has no bagualu._C"
    shutil.copy(found[0][0], tmp_path / found[0][0].name)
    (tmp_path / "_C.torch-version").write_text("2.6.0+cpu\n")
    monkeypatch.setattr(ext, "_candidate_dirs", lambda: [tmp_path])
    monkeypatch.setattr(ext, "_module", None)
    with pytest.raises(LibraryNotFound) as e:
        ext.load()
    text = str(e.value)
    assert "2.6.0+cpu" in text and torch.__version__ in text and "BGL_PYTHON" in text
    (tmp_path / "_C.torch-version").unlink()
    (tmp_path / found[0][0].name).unlink()
    with pytest.raises(LibraryNotFound, match="bgl_python"):
        ext.load()


def test_block_storage_runs_done_once_when_torch_lets_go() -> None:
    m = ext.load()
    backing = torch.arange(16, dtype=torch.uint8)
    seen = []
    st = m.block_storage(backing.data_ptr(), 16, 0, 0, lambda: seen.append(1))
    t = torch.empty(0, dtype=torch.uint8).set_(st, 0, (16,), (1,))
    assert torch.equal(t, backing) and st.data_ptr() == backing.data_ptr()
    del st
    assert seen == []  # the tensor still holds it
    del t
    gc.collect()
    assert seen == [1]


def test_bad_input_at_the_binding_is_an_error_and_changes_nothing() -> None:
    m = ext.load()
    lib = libs.load("libbgl_enforce.so")
    with pytest.raises(ValueError, match="bad block"):
        m.block_storage(0, 16, 0, 0, lambda: None)
    with pytest.raises(ValueError, match="bad block"):
        m.block_storage(64, 16, 7, 0, lambda: None)
    with pytest.raises(TypeError, match="callable"):
        m.block_storage(64, 16, 0, 0, None)
    with pytest.raises(TypeError, match="5 arguments"):
        m.block_storage(64, 16)
    with pytest.raises(ValueError, match="non-zero"):
        m.Enforcer(0, 0, 0)
    with pytest.raises(ValueError, match="non-zero"):
        m.Pool(0, 0)
    enf = Enforcer(torch.device("cpu"), 1 << 20, borrowed_free_is_safe=False)
    try:
        with pytest.raises(TypeError, match="register_saved takes 8 arguments"):
            enf.fast.register_saved(1, 2, 3)
        src = torch.arange(64, dtype=torch.float32)
        h = enf.register(src.untyped_storage(), src.dtype, 0, 0)
        enf.offload(h)
        # A handle the enforcer never gave, a second unregister: statuses, nothing lost.
        unknown = enf.enum_value("status", "unknown_handle")
        assert enf.fast.offload(h + 1000) == unknown
        assert enf.fast.state(h + 1000)[0] == unknown
        assert enf.fast.acquire(h + 1000, 0)[0] == unknown
        rc, placement, _, _ = enf.fast.state(h)
        assert rc == 0 and placement == enf.vocab.place_host
        # A block's end made for what is not an enforcer or a record, or for handle 0: an
        # error naming it, and no block taken.
        with pytest.raises(TypeError, match="enforcer must be an Enforcer"):
            m.block_done(object(), h, None)
        with pytest.raises(TypeError, match="rec must be a record or None"):
            m.block_done(enf, h, object())
        with pytest.raises(ValueError, match="handle 0"):
            m.block_done(enf, 0, None)
        with pytest.raises(TypeError, match="3 arguments"):
            m.block_done(enf, h)
        assert enf.live_blocks == 0
        got = enf.acquire(h, 256)
        assert torch.equal(torch.empty(0).set_(got, 0, (64,), (1,)), src)
        assert enf.live_blocks == 1
        del got
        gc.collect()
        assert enf.live_blocks == 0
        enf.retire(h)
        assert enf.fast.unregister(h) == unknown  # a double release
    finally:
        enf.close()
    assert lib.bgl_enf_last_error()  # the message of the last failed call is there


def test_the_saved_tensor_types_refuse_what_is_not_theirs() -> None:
    """Packed of something that is no record or no tensor, Hooks over a wrong record type or
    pool: a TypeError naming it; an unpack of what no pack made gives it back unchanged (the
    default hooks' contract), and a Packed of a record made elsewhere reaches that record only."""
    m = ext.load()
    from bagualu.capture.tracker import Tracker
    from bagualu.enforce.device import DeviceMemory
    from bagualu.enforce.pool import DevicePool
    from bagualu.record import Record
    from bagualu.vocabulary import Op
    t = torch.ones(4)
    with pytest.raises(TypeError, match="rec must be a record"):
        m.Packed(object(), t)
    memory = DeviceMemory(torch.device("cpu"), DevicePool(1 << 20), None)
    tr = Tracker(memory, None, lambda op, mb: "keep")
    with pytest.raises(TypeError, match="subclass RecordBase"):
        m.Hooks(tr, int, {}, None)
    with pytest.raises(TypeError, match="Pool"):
        m.Hooks(tr, Record, {}, object())
    with pytest.raises(KeyError, match="fp8"):
        m.Hooks(tr, Record, {}, None)
    assert tr.unpack(t) is t  # never packed: returned as it is
    rec = Record(tr, t.untyped_storage(), t.data_ptr(), 16, t.device, t.dtype,
                 Op("x", "linear", 0), 0, 1)
    with pytest.raises(TypeError, match="t must be a tensor"):
        m.Packed(rec, "not a tensor")
    p = m.Packed(rec, t)
    assert rec.refs == 1 and tr.unpack(p) is t
    del p
    assert rec.released and rec.refs == 0


def test_a_records_placement_has_one_owner() -> None:
    """A record's placement is derived, never stored: the binding's names are the vocabulary's,
    it cannot be set, a record holding its storage is on the device, one without it follows its
    enforcer handle, and a handle the enforcer does not know is an error naming it."""
    m = ext.load()
    from bagualu.capture.tracker import Tracker
    from bagualu.enforce.device import DeviceMemory
    from bagualu.enforce.pool import DevicePool
    from bagualu.record import Record
    from bagualu.vocabulary import DEVICE, DROPPED, FP8_PLACE, HOST, Op
    assert m.PLACEMENTS == (DEVICE, HOST, FP8_PLACE, DROPPED)
    t = torch.ones(4)
    tr = Tracker(DeviceMemory(torch.device("cpu"), DevicePool(1 << 20), None), None,
                 lambda op, mb: "keep")
    rec = Record(tr, t.untyped_storage(), t.data_ptr(), 16, t.device, t.dtype,
                 Op("x", "linear", 0), 0, 1)
    assert rec.placement == DEVICE
    with pytest.raises(AttributeError):
        rec.placement = HOST
    rec.storage, rec.regen = None, object()  # dropped, untracked: the rerun holds it
    assert rec.placement == DROPPED
    rec.regen, rec.enf = None, 12345  # a handle no enforcer gave
    with pytest.raises(RuntimeError, match="enforcer handle 12345 is unknown"):
        rec.placement
    rec.enf = 0


def test_an_offloaded_conjugate_or_negative_view_comes_back_with_its_bit() -> None:
    """A saved view with a lazy math bit (conj on a complex view, neg on the imaginary part of
    a conjugate) reads its storage through the bit: the binding's rebuilt view puts it back, so
    offloading changes no gradient (a compiled deepseek_v3 block saves its rotary tables' conj;
    without the bit torchtitan's gradient norms differed from the 5th digit)."""
    import bagualu
    from torch import nn

    class Block(bagualu.OpBlock):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Linear(4, 4)

        def build_steps(self):
            S = bagualu.Step
            return [S("qkv_proj", "linear",
                      lambda x: torch.view_as_complex(self.w(x).view(-1, 2, 2)), ("x",), ("c",)),
                    S("out_proj", "linear",
                      lambda c: torch.view_as_real(c * c.conj()) * c.conj().imag.unsqueeze(-1),
                      ("c",), ("out",))]

    bits = []
    with torch.autograd.graph.saved_tensors_hooks(
            lambda t: bits.append((t.is_conj(), t.is_neg())) or t, lambda t: t):
        torch.manual_seed(0)
        Block()(torch.randn(8, 4)).square().sum().backward()
    assert (True, False) in bits and (False, True) in bits, bits  # the scenario has both bits

    def grad(strategy: str) -> torch.Tensor:
        torch.manual_seed(0)
        m, x = Block(), torch.randn(8, 4)
        bagualu.install(capacity="1MiB", policy="keep-all", governor="none",
                        log_iterations=False)
        try:
            bagualu.instrument(m)
            bagualu.force_strategies({"qkv_proj": strategy, "out_proj": strategy})
            with bagualu.forward(0):
                y = m(x).square().sum()
            with bagualu.backward(0):
                y.backward()
            moved = bagualu.stats()
        finally:
            bagualu.uninstall()
        return m.w.weight.grad, moved

    kept, _ = grad("keep")
    offloaded, stats = grad("offload")
    assert torch.equal(kept, offloaded)
    assert stats["enforcer"]["offloads"] > 0 and stats["enforcer"]["reloads"] > 0, stats


def test_the_issue_cursor_tells_the_scheduler_where_compute_is_and_runs_python_past_a_stage(
) -> None:
    """enforce/order.py's PointIssuer over the binding's IssueCursor: every operator call and
    unpack of the point's units goes to the core (bgl_enf_schedule_at); Python runs only to look
    an operator up once and when compute passed a stage; other units, unplanned operators and
    calls from inside the enforcer's pieces tell nothing; an error in Python reaches the caller
    and leaves the cursor usable."""
    from bagualu.enforce.order import PointIssuer, StageGraphIndex
    from bagualu.vocabulary import Op
    m = ext.load()
    enf = Enforcer(torch.device("cpu"), 1 << 20, borrowed_free_is_safe=False)
    index = StageGraphIndex({"operators": [{"name": "L0.a"}, {"name": "L0.b"}, {"name": "L0.c"}],
                             "tensors": []}, layers_per_chunk=1)
    asked, passed, collected = [], [], []

    class Counting(PointIssuer):
        def _op_index(self, op: Op) -> int:
            asked.append(op.name)
            return super()._op_index(op)

        def _passed(self, status: int, stages: int) -> None:
            passed.append((status, stages))
            super()._passed(status, stages)

    issuer = Counting(enf.scheduler, index, lambda: collected.append(1))
    assert isinstance(issuer, m.IssueCursor)
    a, b, c, x = (Op(n, "other", 0) for n in "abcx")
    order = [{"chain": "F", "stage": 0, "round": 0, "resource": "compute", "first": 0, "last": 1},
             {"chain": "B", "stage": 0, "round": 0, "resource": "compute", "first": 2, "last": 2},
             {"chain": "F", "stage": 1, "round": 1, "resource": "compute", "first": 2, "last": 2},
             {"chain": "B", "stage": 1, "round": 1, "resource": "compute", "first": 0, "last": 1}]
    issuer.forward_op(5, a)  # no order loaded
    assert asked == [] and passed == []
    issuer.begin(order, 5, 7, -1, -1)
    assert issuer.active and (issuer.forward_key, issuer.backward_key) == (5, 7)
    issuer.forward_op(6, a)  # another unit
    assert asked == [] and passed == []
    issuer.forward_op(5, a)  # F0 from operator 0
    assert asked == ["a"] and passed == [(0, 1)] and collected == [1]
    issuer.forward_op(5, b)  # inside F0
    issuer.forward_op(5, a)  # looked up once
    issuer.forward_op(5, x)  # not a planned operator
    assert asked == ["a", "b", "x"] and passed == [(0, 1)]
    issuer.issuing = True  # as while the enforcer carries out a piece
    issuer.forward_op(5, c)
    issuer.issuing = False
    assert passed == [(0, 1)]
    issuer.forward_op(5, c)  # F1
    assert passed == [(0, 1), (0, 1)] and not issuer.issuing
    issuer.backward_op(5, a)  # the forward's unit is not the backward's
    issuer.backward_op(7, b)  # B0 runs from c down: b passes it
    assert passed[-1] == (0, 1)
    issuer.backward_op(7, a)  # B1
    issuer.backward_op(7, a)  # nothing left to pass
    assert passed == [(0, 1)] * 4 and collected == [1] * 4

    def fail(status: int, stages: int) -> None:
        raise RuntimeError("from _passed")
    issuer.begin(order, 5, 7, -1, -1)
    issuer._passed = fail  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="from _passed"):
        issuer.forward_op(5, a)
    assert not issuer.issuing and issuer.active
    del issuer._passed
    issuer.finish()
    assert not issuer.active and collected == [1] * 5
    issuer.forward_op(5, c)  # after the point: nothing
    assert passed == [(0, 1)] * 4
    with pytest.raises(TypeError, match="forward_op\\(unit, op\\) takes 2 arguments"):
        issuer.forward_op(5)
    with pytest.raises(TypeError, match="Enforcer or None"):
        m.IssueCursor("enforcer")
    enf.close()


def test_a_malformed_issue_order_is_refused_naming_the_item_and_loads_nothing() -> None:
    """schedule_begin, the one reader of a plan's issue items: an unknown chain or resource, a
    missing or non-int field, an item that is not a dict, a wrong argument: a clear error naming
    the item, nothing loaded (the order before it still runs)."""
    m = ext.load()
    enf = Enforcer(torch.device("cpu"), 1 << 20, borrowed_free_is_safe=False)
    good = {"chain": "F", "stage": 0, "round": 0, "resource": "compute", "first": 0}
    assert m.schedule_begin(enf.fast, [good], -1, -1) == 0
    for bad, match in [([good, dict(good, chain="Q")], "issue item 1: chain 'Q' unknown"),
                       ([dict(good, resource="disk")], "issue item 0: resource 'disk' unknown"),
                       ([{k: v for k, v in good.items() if k != "stage"}], "item 0: no 'stage'"),
                       ([dict(good, round="1")], "item 0: 'round' must be an int, not str"),
                       ([("F", 0)], "issue item 0: a dict, not tuple")]:
        with pytest.raises(ValueError, match=match):
            m.schedule_begin(enf.fast, bad, -1, -1)
    with pytest.raises(TypeError, match="takes 4 arguments"):
        m.schedule_begin(enf.fast, [good], -1)
    with pytest.raises(TypeError, match="bagualu._C.Enforcer, not int"):
        m.schedule_begin(3, [good], -1, -1)
    # an order the core refuses (stages of a chain going back) is its status, the message named
    with pytest.raises(BagualuError, match="schedule_begin.*order inside a chain"):
        enf.scheduler.begin([dict(good, stage=1), good], -1, -1)
    # the loaded order is still the first one: compute at operator 0 passes its one stage
    passed = []

    class Probe(m.IssueCursor):
        def _op_index(self, op: object) -> int:
            return 0

        def _passed(self, status: int, stages: int) -> None:
            passed.append((status, stages))
    probe = Probe(enf.fast)
    probe.active, probe.forward_key = True, 1
    probe.forward_op(1, object())
    assert passed == [(0, 1)]
    enf.close()

"""What [kernels] selects on this backend, and why, as the status shows it."""

import pytest

from appliance.kernels.registry import KERNELS, backend, refusal, report, select


def test_every_kernel_has_a_spec_key_and_a_self_test():
    from appliance.kernels.registry import CHECKED_BY
    from appliance.spec import KernelsSpec

    assert set(KernelsSpec.model_fields) == set(KERNELS) == set(CHECKED_BY)


@pytest.mark.skipif(backend() == "cuda", reason="CUDA has native kernels (tests/kernels/test_kv_move.py)")
def test_auto_runs_the_generic_path_where_no_native_kernel_exists():
    chosen = select("kv_dequantize", "auto")
    assert (chosen.chosen, chosen.why) == ("generic", f"no native kv_dequantize kernel for the {backend()} backend yet")
    assert select("kv_quantize", "generic").chosen == "generic"
    assert refusal("kv_quantize", "auto") is None and refusal("kv_quantize", "native") is not None


def test_the_report_says_what_was_asked_what_runs_and_why():
    assert report({"kv_quantize": "generic"}) == {"kv_quantize": {"asked": "generic", "chosen": "generic",
                                                                  "why": "asked for"}}


def test_apply_hands_over_what_runs_now():
    from appliance.kernels.registry import apply

    calls = []
    apply({"kv_quantize": "auto", "kv_dequantize": "generic", "small_matmul": "auto"}, calls.append)
    native = backend() == "cuda"  # auto waits for the self-test there: generic until it passed
    assert {name: s.chosen for name, s in calls[0].items()} == dict.fromkeys(calls[0], "generic") or native


class Store:  # records what the KV store is told
    def __init__(self):
        self.told = []

    def use_native(self, **kw):
        self.told.append(kw)


def test_switch_tells_the_models_and_the_store():
    from appliance.kernels import small_matmul
    from appliance.kernels.registry import Selection, switch

    def chosen(asked: str, **native: bool) -> dict[str, Selection]:
        return {name: Selection(name, asked, "native" if on else "generic", "") for name, on in native.items()}

    store = Store()
    try:
        switch(store, chosen("auto", kv_quantize=True, kv_dequantize=False, small_matmul=True))
        assert small_matmul.ENABLED and small_matmul.MEASURED  # auto: each engine measures
        assert store.told == [{"quantize": True, "dequantize": False}]
        switch(None, chosen("native", kv_quantize=True, kv_dequantize=True, small_matmul=True))  # no store yet
        assert small_matmul.ENABLED and not small_matmul.MEASURED  # asked for: always ours
        switch(None, chosen("auto", small_matmul=False))
        assert not small_matmul.ENABLED and not small_matmul.MEASURED
    finally:
        small_matmul.ENABLED = small_matmul.MEASURED = False


def test_the_self_test_runs_between_the_engines_steps():
    """Its checks load kernel modules, which may synchronize the GPU (kernels/gate.py)."""
    from appliance.kernels.gate import GATE
    from appliance.kernels.registry import _SelfTest

    test = _SelfTest()
    with GATE.shared():  # an engine's step under way
        test.start()
        assert not test.done.wait(0.3)
    assert test.done.wait(60)

"""What [kernels] selects on this backend, and why, as the status shows it."""

from appliance.kernels.registry import KERNELS, backend, refusal, report, select


def test_every_kernel_has_a_spec_key():
    from appliance.spec import KernelsSpec

    assert set(KernelsSpec.model_fields) == set(KERNELS)


def test_auto_runs_the_generic_path_where_no_native_kernel_exists():
    chosen = select("kv_dequantize", "auto")
    assert (chosen.chosen, chosen.why) == ("generic", f"no native kv_dequantize kernel for the {backend()} backend yet")
    assert select("kv_quantize", "generic").chosen == "generic"
    assert refusal("kv_quantize", "auto") is None and refusal("kv_quantize", "native") is not None


def test_the_report_says_what_was_asked_what_runs_and_why():
    assert report({"kv_quantize": "generic"}) == {"kv_quantize": {"asked": "generic", "chosen": "generic",
                                                                  "why": "asked for"}}

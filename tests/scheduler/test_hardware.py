from __future__ import annotations

import pytest

from scheduler.hardware import CATALOG, GpuSpec, gpu_spec, known_gpus, resolve_gpu_name


def test_the_catalog_has_the_gpus_the_issue_names() -> None:
    assert set(known_gpus()) == {"H200", "H100-SXM", "A100-80G", "A100-40G", "L40S", "A10G", "Ascend-910B"}


def test_every_catalog_entry_cites_a_source() -> None:
    for spec in CATALOG.values():
        assert spec.source.startswith("https://"), spec.name


def test_ascend_910b_is_marked_low_confidence_because_public_figures_conflict() -> None:
    assert CATALOG["Ascend-910B"].confidence == "low"
    assert "conflict" in CATALOG["Ascend-910B"].note


def test_it_stores_dense_bf16_not_the_sparsity_figure() -> None:
    # H100 SXM datasheet: 1,979 TFLOPS with sparsity, 989 dense
    assert CATALOG["H100-SXM"].bf16_flops == pytest.approx(989e12)
    assert CATALOG["A100-80G"].bf16_flops == pytest.approx(312e12)


def test_link_bandwidths_are_per_direction() -> None:
    # datasheet NVLink 900 GB/s (both directions) -> 450 GB/s each way
    assert CATALOG["H100-SXM"].intra_link_bytes_per_s == pytest.approx(450e9)
    assert CATALOG["L40S"].intra_link_bytes_per_s == 0


def test_an_unknown_name_is_an_error_that_lists_the_known_ones() -> None:
    with pytest.raises(ValueError) as err:
        gpu_spec("B200")
    message = str(err.value)
    assert "B200" in message
    for name in known_gpus():
        assert name in message


def test_it_resolves_nvml_names_and_case() -> None:
    assert resolve_gpu_name("NVIDIA A100-SXM4-80GB") == "A100-80G"
    assert resolve_gpu_name("h100-sxm") == "H100-SXM"


def test_a_custom_spec_takes_precedence_and_round_trips() -> None:
    spec = GpuSpec.from_dict(
        {"name": "X9", "bf16_flops": 1e14, "mem_bytes": 32 * 10**9, "hbm_bytes_per_s": 1e12, "host_link_bytes_per_s": 3.2e10}
    )
    assert spec.confidence == "medium"
    assert gpu_spec("X9", {"X9": spec}) is spec
    assert GpuSpec.from_dict(spec.to_dict()) == spec


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"bf16_flops": "fast"}, "spec.bf16_flops: must be a number"),
        ({"mem_bytes": 0}, "spec.mem_bytes: must be > 0"),
        ({"confidence": "sure"}, "spec.confidence: must be one of"),
        ({"colour": "green"}, "spec.colour: unknown key"),
    ],
)
def test_a_malformed_custom_spec_names_the_field(change: dict[str, object], message: str) -> None:
    d: dict[str, object] = {
        "name": "X9", "bf16_flops": 1e14, "mem_bytes": 10**10, "hbm_bytes_per_s": 1e12, "host_link_bytes_per_s": 3e10,
    }
    d.update(change)
    with pytest.raises(ValueError, match=message):
        GpuSpec.from_dict(d)


def test_a_custom_spec_without_a_required_field_says_which() -> None:
    with pytest.raises(ValueError, match="spec.hbm_bytes_per_s: required"):
        GpuSpec.from_dict({"name": "X9", "bf16_flops": 1e14, "mem_bytes": 10**10, "host_link_bytes_per_s": 3e10})

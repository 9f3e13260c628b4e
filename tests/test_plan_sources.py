"""Every figure the planner prices a step with names where it comes from, and no other number
hides in its cost code (issue: a planner validated on tables none of its figures was fitted
to)."""

import ast
import dataclasses
import math
import re

import pytest
from mpirun import REPO

from hpcllm.plan import costs, hardware, sources
from hpcllm.plan.sources import FIGURES, KINDS, SHAPE_FACTOR, SHAPE_FACTOR_SOURCE

COST_CODE = [REPO / "hpcllm" / "plan" / "costs.py", REPO / "hpcllm" / "plan" / "hardware.py"]
# Input checks, not figures: a measured shape table's share above this is refused as no share.
INPUT_BOUNDS = {1.5}


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_every_figure_has_a_kind_and_a_source(name):
    figure = FIGURES[name]
    assert figure.kind in KINDS, name
    assert len(figure.source) > 20, name
    assert figure.value > 0, name
    if figure.kind == "publication":  # authors or a named work, and a year or a table
        assert re.search(r"(19|20)\d\d", figure.source), name


def test_every_measurement_names_a_report_that_exists():
    measured = [f for f in [*FIGURES.values(), SHAPE_FACTOR_SOURCE] if f.kind == "measurement"]
    assert measured
    for figure in measured:
        paths = re.findall(r"docs/reports/[\w./-]+", figure.source)
        assert paths, figure.source
        for path in paths:
            assert (REPO / path.rstrip(".")).exists(), path


def _reported_specs(figure: sources.Figure) -> list[dict]:
    """Return the gpu_spec mappings of the device.yaml reports a figure's source names."""
    import yaml

    return [
        yaml.safe_load((REPO / path).read_text())["gpu_spec"]
        for path in re.findall(r"docs/reports/[\w./-]+\.yaml", figure.source)
    ]


def test_the_measured_figures_are_their_reports_means():
    # Each point of the shape table, Hopper's flash efficiency and the copy share: the mean
    # of the two device.yaml files their sources name.
    specs = _reported_specs(SHAPE_FACTOR_SOURCE)
    assert len(specs) == 2
    for dim, share in SHAPE_FACTOR:
        assert share == pytest.approx(sum(s["shape_factor"][dim] for s in specs) / 2, abs=1e-4)
    for name, key in (("h100.flash_efficiency", "flash_efficiency"),
                      ("memory_efficiency", "memory_efficiency")):  # fmt: skip
        specs = _reported_specs(FIGURES[name])
        assert len(specs) == 2, name
        assert FIGURES[name].value == pytest.approx(sum(s[key] for s in specs) / 2), name


def test_every_gpu_kind_is_made_of_its_own_figures():
    generation = {"a100-40gb": "a100", "a100-80gb": "a100", "h100-sxm": "h100",
                  "h100-pcie": "h100", "h200": "h100"}  # fmt: skip
    sfu = {"a100-40gb": "a100", "a100-80gb": "a100", "h100-sxm": "h100-sxm",
           "h100-pcie": "h100-pcie", "h200": "h100-sxm"}  # fmt: skip
    assert set(hardware.GPUS) == set(generation)
    for name, gpu in hardware.GPUS.items():
        for field in ("peak_bf16", "peak_fp32", "memory_gb", "hbm_gbps"):
            assert getattr(gpu, field) == sources.value(f"{name}.{field}"), (name, field)
        for field in ("gemm_ceiling", "flash_efficiency"):
            assert getattr(gpu, field) == sources.value(f"{generation[name]}.{field}")
        assert gpu.memory_efficiency == sources.value("memory_efficiency")
        assert gpu.sfu_tops == sources.value(f"{sfu[name]}.sfu_tops")
        assert gpu.shape_factor == SHAPE_FACTOR
    # Every field a kind has is one of those checked above.
    checked = {"name", "peak_bf16", "peak_fp32", "memory_gb", "hbm_gbps", "gemm_ceiling",
               "flash_efficiency", "memory_efficiency", "sfu_tops", "shape_factor"}  # fmt: skip
    assert {f.name for f in dataclasses.fields(hardware.GPU)} == checked


@pytest.mark.parametrize("path", COST_CODE, ids=lambda p: p.name)
def test_the_cost_code_holds_no_figure_of_its_own(path):
    # Integers are counts the docstrings derive (bytes per value, passes, collectives) and
    # powers of ten convert units; any other fraction would be a figure, and figures live in
    # hpcllm/plan/sources.py with a source.
    fractions = [
        (node.lineno, node.value)
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant)
        and isinstance(node.value, float)
        and not node.value.is_integer()
        and not math.log10(node.value).is_integer()
        and node.value not in INPUT_BOUNDS
    ]
    assert not fractions, fractions


def test_a_software_profile_is_a_list_of_what_it_overlaps_and_fuses():
    # The three profiles docs/plan.md describes differ where their software does.
    hpcllm, old, core = (costs.Software.named(n) for n in costs.SOFTWARE)
    assert (hpcllm.dp_overlap, hpcllm.tp_overlap, hpcllm.p2p_overlap) == (True, False, False)
    assert (old.dp_overlap, old.tp_overlap, old.p2p_overlap, old.attention) == (
        True,
        False,
        False,
        "unfused",
    )
    assert hpcllm.dp_overlap_with_pipeline and not old.dp_overlap_with_pipeline
    assert core.tp_overlap and core.p2p_overlap and core.param_gather_overlap
    assert core.weights == "mixed" and core.grad_bytes == 4 and core.distributed_optimizer

"""The claims of docs/architecture.md and docs/guarantees.md that code can check, each
checked against the source: who imports torch and ray, who builds a plan from a spec, who
tests the kind of a dataset, who names a loader mode, where compatibility with earlier
releases lives, and where the loader's knobs become flags. No Ray."""

from __future__ import annotations

import argparse
import ast
import re
import runpy
from pathlib import Path

import pytest
import tomllib

from raypipe.sampling.modes import knob_fields, mode_names

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "raypipe"


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported(path: Path) -> set[str]:
    """The top-level packages a module imports, at module level or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def layer_of(module: str, layers: list[str]) -> int:
    """The index of `module`'s layer in pyproject's layers contract (the package itself,
    and anything above the first layer, counts as the top: -1)."""
    for index, layer in enumerate(layers):
        for member in layer.split("|"):
            member = member.strip()
            if module == member or module.startswith(member + "."):
                return index
    return -1


def layers() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contract = next(c for c in config["tool"]["importlinter"]["contracts"]
                    if c["type"] == "layers")
    return contract["layers"]


def source_of(*relative: str) -> dict[str, str]:
    return {name: (PACKAGE / name).read_text() for name in relative}


@pytest.mark.parametrize("library, lowest", [("torch", "raypipe.loader"),
                                             ("ray", "raypipe.ray")])
def test_nothing_below_loader_imports_torch_and_nothing_below_ray_imports_ray(library,
                                                                               lowest):
    """architecture.md and guarantees.md: only loader/ and the layers above it (ray/,
    examples/, demo/, cli) import torch; only ray/ and those above it import ray."""
    order = layers()
    limit = layer_of(lowest, order)
    below = sorted(module for module, path in modules().items()
                   if library in imported(path) and layer_of(module, order) > limit)
    assert not below, f"{library} imported below {lowest}: {below}"


PLAN_CALL = re.compile(r"(?:\bmode|loader_mode|get_mode\([^)]*\))\.plan\(")


def test_epoch_plans_are_the_one_place_a_loaders_plan_is_built_from_a_spec():
    """architecture.md: `EpochPlans` builds every plan a loader, trace, pack-report and the
    Ray datasource run; the one other call of a mode's `plan` is `record_plan`, the plan of
    an LLMBATCH output's records, in the batches mode's own module."""
    calls = {str(path.relative_to(PACKAGE)): len(PLAN_CALL.findall(path.read_text()))
             for path in PACKAGE.rglob("*.py") if PLAN_CALL.search(path.read_text())}
    assert calls == {"sampling/epochs.py": 1, "sampling/modes/batches.py": 1}, calls
    batches = (PACKAGE / "sampling/modes/batches.py").read_text()
    record_plan = batches[batches.index("def record_plan("):]
    assert PLAN_CALL.search(record_plan[:record_plan.index("\nclass ")])


SHUFFLE_PIECES = {"for_storage", "for_world", "for_budget"}  # PlanSpec's, called by resolve


def shuffle_choices(path: Path) -> list[int]:
    """Lines of a module that choose a spec's shuffle: a call of one of PlanSpec's
    resolving pieces, or a `shuffle=` keyword of a call to `replace`, outside the pieces'
    own bodies."""
    tree = ast.parse(path.read_text())
    pieces = [range(node.lineno, node.end_lineno + 1) for node in ast.walk(tree)
              if isinstance(node, ast.FunctionDef) and node.name in SHUFFLE_PIECES]
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or any(node.lineno in piece for piece in pieces):
            continue
        function = node.func
        name = getattr(function, "attr", getattr(function, "id", ""))
        if name in SHUFFLE_PIECES or (name == "replace" and any(
                keyword.arg == "shuffle" for keyword in node.keywords)):
            lines.append(node.lineno)
    return lines


def test_resolve_is_the_one_place_that_chooses_a_shuffle():
    """architecture.md: a spec's shuffle "auto" and its layout's 0 knobs are decided by
    `raypipe.sampling.resolve` alone (from storage, world size, budget, a resumed state, a
    mixture's sibling); the pieces it calls are PlanSpec's own methods, which nothing else
    calls, and no other module sets a spec's shuffle."""
    found = {str(path.relative_to(PACKAGE)): shuffle_choices(path)
             for path in PACKAGE.rglob("*.py")}
    assert {name for name, lines in found.items() if lines} == {"sampling/resolve.py"}, found


def constructions(name: str) -> set[str]:
    """Where the package constructs class `name`: "module:function" of each call of it
    (a `cls(...)` in a method of the class counts)."""
    found = set()
    for module, path in modules().items():
        tree = ast.parse(path.read_text())
        owners = {id(method): node.name for node in ast.walk(tree)
                  if isinstance(node, ast.ClassDef) for method in node.body}
        for function in ast.walk(tree):
            if not isinstance(function, ast.FunctionDef):
                continue
            callers = {name, "cls"} if owners.get(id(function)) == name else {name}
            if any(isinstance(node, ast.Call) and getattr(node.func, "id", None) in callers
                   for node in ast.walk(function)):
                found.add(f"{module}:{function.name}")
    return found


def test_a_planned_dataset_is_built_where_a_run_opens_and_where_its_data_changes():
    """architecture.md: a run's PlannedDataset is constructed when the run opens and
    again only when its data changes (units join, a manifest grows); adopting a resumed
    state's or a mixture sibling's shuffle re-plans the same one (`adopt_spec`)."""
    assert constructions("PlannedDataset") == {"raypipe.sampling.epochs:open",
                                               "raypipe.sampling.epochs:with_data"}


def called(path: Path, names: set[str]) -> set[str]:
    """Which of `names` a module calls (a function, or a method by its attribute name)."""
    return {getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Call)
            } & names


def test_epochs_roll_over_in_the_schedule_alone():
    """architecture.md: one walker owns where a run goes next: raypipe.sampling.schedule
    walks a run's steps (segments, drop-last at each epoch's end) and a mixture source's
    rows (`walk_rows`) and is the one module that begins a next epoch's phases; a run
    moves its cursor there only when it served an epoch to its end."""
    rollovers = {"next_epoch_phases", "next_epoch"}
    found = {str(path.relative_to(PACKAGE)): called(path, rollovers)
             for path in PACKAGE.rglob("*.py")}
    assert {name: calls for name, calls in found.items() if calls} == {
        "sampling/schedule.py": rollovers, "sampling/run.py": {"next_epoch"}}
    assert called(PACKAGE / "sampling/mixture.py", {"walk_rows"}) == {"walk_rows"}


SEAMS = ("loader/view.py", "loader/token_loader.py", "loader/mixture.py", "loader/options.py",
         "loader/contract.py", "sampling/run.py", "sampling/mixture_run.py")


def untyped_returns(path: Path) -> list[str]:
    """The functions of a module whose return annotation is, or iterates, `Any`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef) and node.returns is not None:
            returned = ast.unparse(node.returns)
            if re.fullmatch(r"Any|(?:Iterator|Iterable|Generator)\[Any.*\]", returned):
                found.append(f"{node.name} -> {returned}")
    return found


def test_the_seams_of_the_training_wing_return_no_any():
    """architecture.md: the loaders, their options and contract, and the runs they view
    say what they return (a plan is an EpochPlan, a dataset a TokenDataset or
    BatchDataset, a batch a Batch)."""
    assert {seam: untyped_returns(PACKAGE / seam) for seam in SEAMS} == dict.fromkeys(SEAMS,
                                                                                    [])


VIEWS = ("loader/token_loader.py", "loader/mixture.py", "tools/trace.py")
CURSOR_NAMES = re.compile(r"step|epoch|position|global_batch|world_size|observation|rows")


def cursor_arithmetic(path: Path) -> list[str]:
    """The arithmetic of a module (+ - * / // %) on a name that says step, epoch,
    position, global batch, world size, observations or rows, as source lines."""
    source = path.read_text()
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.BinOp | ast.AugAssign) and isinstance(
                node.op, ast.Add | ast.Sub | ast.Mult | ast.Div | ast.FloorDiv | ast.Mod):
            names = {getattr(part, "id", None) or getattr(part, "attr", None)
                     for part in ast.walk(node)}
            if any(name and CURSOR_NAMES.search(name) for name in names):
                found.append(ast.get_source_segment(source, node) or str(node.lineno))
    return found


def test_the_views_compute_no_step_epoch_or_position_and_stay_small():
    """architecture.md: the loaders and trace are views of a run, which owns where training
    stands: no view computes a step, an epoch, a position or a rank's share of a step, and
    the three stay within 600 lines together."""
    paths = [PACKAGE / view for view in VIEWS]
    assert {view: cursor_arithmetic(path) for view, path in zip(VIEWS, paths, strict=True)
            } == dict.fromkeys(VIEWS, [])
    lines = sum(len(path.read_text().splitlines()) for path in paths)
    assert lines <= 600, f"the views hold {lines} lines"


KIND_TEST = re.compile(r"hasattr\(|isinstance\([^)]*(?:Dataset|Format|TokenSource)\b"
                       r"|\b(?:dataset|fmt|format|source|mode)\.(?:kind|serves)\s*[!=]="
                       r"|\btype\([^)]*\)\s*(?:is|==)")


def test_the_epoch_plans_the_run_the_loaders_and_the_tools_never_test_the_kind():
    """architecture.md: they open a dataset through the opener and ask it (or dispatch on
    `dataset.kind` through one table, or on the loader mode); none tests which kind of
    dataset or format it holds."""
    files = ["sampling/epochs.py", "sampling/run.py", "tools/convert.py", "tools/inspect.py",
             "tools/verify.py", "tools/pack_report.py", "tools/trace.py",
             *(str(p.relative_to(PACKAGE)) for p in (PACKAGE / "loader").glob("*.py"))]
    tests = {name: KIND_TEST.findall(text) for name, text in source_of(*files).items()
             if KIND_TEST.search(text)}
    assert not tests, tests


def test_the_loader_the_run_trace_pack_report_the_packer_and_the_cli_name_no_mode():
    """modes/base.py and architecture.md: nothing outside a mode's module names it; they
    find it through the registry (a mode whose name is also a kind of format, documents
    or batches, is looked up by that kind)."""
    files = ["sampling/run.py", "sampling/epochs.py", "tools/trace.py",
             "tools/pack_report.py", "preprocess/batch_packing.py", "cli.py",
             *(str(p.relative_to(PACKAGE)) for p in (PACKAGE / "loader").glob("*.py"))]
    named = {(name, mode) for name, text in source_of(*files).items()
             for mode in set(mode_names()) - {"documents", "batches"}
             if re.search(rf"[\"']{mode}[\"']", text)}
    assert not named, named


COMPATIBILITY = {"config/compat.py", "sampling/state_compat.py", "io/manifest_compat.py"}
EARLIER_RELEASE = re.compile(
    r"legacy|retired|deprecat|[A-Z_]*RENAMES\b"
    r"|\b(?:raypipe|releases?|before|after|since|until|in|of|then)\s+(?:<=\s*)?0\.\d(?![\d.])"
    r"|\b0\.\d(?:'s\b|-0\.\d\b(?!\s*(?:us|ms|s)\b))|\(0\.\d:")


def test_only_the_compatibility_modules_name_an_earlier_release():
    """architecture.md: one compatibility module per record kind (the config's, the loader
    state's, the manifest's); no other module of raypipe or jobs/ names an earlier
    release, a retired flag or a renamed key."""
    paths = [*PACKAGE.rglob("*.py"), *(ROOT / "jobs").rglob("*.py")]
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
             for path in paths if str(path.relative_to(PACKAGE)
                                      if path.is_relative_to(PACKAGE) else path)
             not in COMPATIBILITY
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if EARLIER_RELEASE.search(line)]
    assert not found, "\n".join(found)
    for name in COMPATIBILITY:
        assert EARLIER_RELEASE.search((PACKAGE / name).read_text()), name


def old_shape_constants() -> dict[str, str]:
    """The module-level constants of the compatibility modules (rename tables, values
    from before a knob or field existed, sentinels): the old shapes, by name."""
    found = {}
    for name in COMPATIBILITY:
        for node in ast.parse((PACKAGE / name).read_text()).body:
            targets = (node.targets if isinstance(node, ast.Assign) else [node.target]
                       if isinstance(node, ast.AnnAssign) else [])
            found.update({target.id: name for target in targets
                          if isinstance(target, ast.Name) and target.id.isupper()})
    return found


def test_old_shapes_are_named_only_inside_the_compatibility_modules():
    """architecture.md: compatibility is a translation at read time: the other modules
    call a compatibility module's upgrade (a function or class) where they read a config,
    manifest, format file or state, and never name an old shape's table, value or
    sentinel themselves, so no branch on an old shape sits outside those modules."""
    constants = old_shape_constants()
    assert {"PAD_BEFORE_LENGTHS", "MODE_KNOBS_BEFORE", "SECTION_RENAMES",
            "UNIT_BYTES_BEFORE_AUTO"} <= set(constants)
    found = []
    for path in [*PACKAGE.rglob("*.py"), *(ROOT / "jobs").rglob("*.py")]:
        if path.is_relative_to(PACKAGE) and str(path.relative_to(PACKAGE)) in COMPATIBILITY:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            name = (node.id if isinstance(node, ast.Name) else node.attr
                    if isinstance(node, ast.Attribute) else node.name
                    if isinstance(node, ast.alias) else None)
            if name in constants:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}"
                             if hasattr(node, "lineno") else f"{path.relative_to(ROOT)}: {name}")
    assert not found, "\n".join(found)


def test_the_training_job_takes_every_loader_knob_from_the_generated_flags():
    """architecture.md: the loader's knobs are declared once (PlanSpec and each mode's
    Knobs); jobs/train.py's flags for them are made from that declaration, as the CLI's."""
    parser: argparse.ArgumentParser = runpy.run_path(str(ROOT / "jobs/train.py"))[
        "build_parser"]()
    flags = {option for action in parser._actions for option in action.option_strings}
    missing = [name for name in knob_fields() if f"--{name.replace('_', '-')}" not in flags]
    assert not missing, missing
    text = (ROOT / "jobs/train.py").read_text()
    assert not re.search(r"add_argument\(\s*\"--(?:mode|seed|shuffle|split)\"", text)


def test_importing_the_loader_loads_no_module_of_the_tokenize_side_or_the_tools():
    """The two wings are joined only by files: a training process that imports the loader
    imports nothing of preprocess/ or tools/ (import-linter checks the imports; this, what
    a fresh interpreter actually loads)."""
    import subprocess
    import sys

    code = ("import sys, raypipe.loader; "
            "print(*sorted(m for m in sys.modules if m.startswith('raypipe')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, cwd=ROOT).stdout.split()
    assert "raypipe.loader.token_loader" in loaded
    assert [m for m in loaded if m.startswith(("raypipe.preprocess", "raypipe.tools"))] == []


MEASURED = re.compile(r"(?<![\w.])~?\d[\d,]*(?:\.\d+)?(?:\s?(?:ms|us|µs|ns|s|GB/s|MB/s|GiB/s"
                      r"|M tokens/s|M/s)|x)(?![\w/])")


def test_no_docstring_holds_more_than_one_measured_figure():
    """A docstring says what and why with one cost figure at most; measurements belong in
    docs/benchmarks.md (a figure: a number with a unit of time, of rate, or a ratio)."""
    crowded = []
    for path in sorted((ROOT / "raypipe").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef |
                          ast.ClassDef):
                figures = MEASURED.findall(ast.get_docstring(node, clean=False) or "")
                if len(figures) > 1:
                    crowded.append(f"{path.relative_to(ROOT)}:{getattr(node, 'name', '')} "
                                   f"{figures}")
    assert crowded == []


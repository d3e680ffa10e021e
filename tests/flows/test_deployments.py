"""prefect.yaml and deployments/register.py declare the same deployments."""

from __future__ import annotations

import yaml

from deployments.register import SPECS, build_deployments
from forgeflow.common.settings import REPO_ROOT


def _yaml_deployments():
    return {d["name"]: d for d in yaml.safe_load((REPO_ROOT / "prefect.yaml").read_text())["deployments"]}


def _all_flows() -> set[str]:
    """``path:function`` of every Prefect flow defined in ``flows/`` but the private subflows (a leading ``_``:
    run only by their parent flow with in-memory inputs)."""
    import importlib

    from prefect import Flow

    out = set()
    for path in sorted((REPO_ROOT / "flows").glob("*.py")):
        module = importlib.import_module(f"flows.{path.stem}")
        out |= {f"flows/{path.name}:{obj.fn.__name__}" for obj in vars(module).values()
                if isinstance(obj, Flow) and obj.fn.__module__ == module.__name__ and not obj.fn.__name__.startswith("_")}
    return out


def test_every_flow_has_a_deployment_in_both_places():
    declared = _yaml_deployments()
    assert set(declared) == {s["name"] for s in SPECS}
    assert _all_flows() == {s["entrypoint"] for s in SPECS}
    for spec in SPECS:
        entry = declared[spec["name"]]
        assert entry["entrypoint"] == spec["entrypoint"]
        assert entry["parameters"] == spec["parameters"]
        assert entry["work_pool"]["name"] == "local"
        path, func = entry["entrypoint"].split(":")
        assert (REPO_ROOT / path).is_file() and spec["flow"].fn.__name__ == func


def test_weekly_registry_audit_schedule_is_paused():
    sched = _yaml_deployments()["registry-audit"]["schedules"]
    assert sched == [{"cron": "0 3 * * 1", "timezone": "UTC", "active": False}]


def test_nightly_lifecycle_schedule_is_paused():
    sched = _yaml_deployments()["lifecycle"]["schedules"]
    assert sched == [{"cron": "0 2 * * *", "timezone": "UTC", "active": False}]
    lifecycle = next(d for d in build_deployments() if d.name == "lifecycle")
    assert [s.active for s in lifecycle.schedules] == [False]


def test_deployment_parameters_validate_against_the_flows():
    """Every parameter a deployment gives is one of its flow's and has the flow's type; a required
    parameter may be left out (Prefect asks for it at run time) but never given a placeholder, and no
    path parameter is relative (a worker's working directory is not the user's)."""
    import inspect
    from pathlib import PurePath

    from pydantic import TypeAdapter

    placeholders = ("", [], {})
    for spec in SPECS:
        signature = inspect.signature(spec["flow"].fn)
        hints = __import__("typing").get_type_hints(spec["flow"].fn)
        for name, value in spec["parameters"].items():
            assert name in signature.parameters, (spec["name"], name)
            TypeAdapter(hints[name]).validate_python(value)  # raises on a type mismatch
            assert value not in placeholders, f"{spec['name']}: {name}={value!r} is a placeholder, not a default"
            if "Path" in str(hints[name]) and isinstance(value, str):
                assert PurePath(value).is_absolute(), f"{spec['name']}: {name}={value!r} is a relative path"

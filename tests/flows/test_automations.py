"""The automations' run parameters, rendered as Prefect's server renders them (hydration + Jinja), without a
server: the freeze-on-ready automation gives the freeze deployment one ``params`` object that the freeze
flow's model accepts, and the canary-on-freeze automation reads the freeze name from the completed run's
``params``. (tests/flows/test_service.py and test_canary_trigger.py run both through a real server.)"""

from __future__ import annotations

from uuid import uuid4

from deployments import automations


def _render(parameters: dict, context: dict) -> dict:
    """As ``RunDeployment.render_parameters`` on the server: plain strings with Jinja upgraded to templates,
    then hydrated with the template context."""
    import copy

    from prefect.server.events.actions import RunDeployment
    from prefect.utilities.schema_tools.hydration import HydrationContext, hydrate

    parameters = copy.deepcopy(parameters)
    RunDeployment._upgrade_v1_templates(parameters)
    return hydrate(parameters, HydrationContext(render_jinja=True, jinja_context=context, raise_on_error=True))


def test_freeze_on_ready_renders_one_params_object_the_freeze_flow_accepts():
    from flows.stages import FreezeParams
    from forgeflow.curation.freeze import SplitQuotas

    quotas = {"train": 5, "validation": 0, "test": 3, "max_per_repo": 7, "min_repos": 2}
    payload = {"store_url": "sqlite:///x.db", "freeze_name": "team-v7", "quotas": quotas, "seed": 3,
               "instance_ids": ["repo-a.x1", "repo-b.y2"], "counts": {"train": 2}, "accepted": 2, "batches": []}
    (action,) = automations.freeze_on_ready(str(uuid4())).actions
    rendered = _render(action.parameters, {"event": {"payload": payload}})

    assert list(rendered) == ["params"]  # one parameter: a run's params replaces the deployment's whole object
    assert rendered["params"] == {"name": "team-v7", "quotas": quotas, "seed": 3,
                                  "instance_ids": ["repo-a.x1", "repo-b.y2"]}  # JSON types kept
    params = FreezeParams.model_validate(rendered["params"])
    assert params.quotas == SplitQuotas(**quotas) and params.instance_ids == ("repo-a.x1", "repo-b.y2")
    assert params.out_dir is None  # the model's default, not a payload key


def test_canary_on_freeze_renders_the_freeze_name_from_the_completed_runs_params():
    from prefect.server.schemas.core import FlowRun

    (action,) = automations.canary_on_freeze(str(uuid4()), str(uuid4())).actions
    run = FlowRun(flow_id=uuid4(), parameters={"params": {"name": "trigger-v1", "seed": 0}})
    assert _render(action.parameters, {"flow_run": run}) == {"freeze_name": "trigger-v1"}


def test_freeze_deployment_records_a_name_even_when_a_run_gives_no_params():
    """A run of the freeze deployment without parameters still records ``params.name`` (the deployment gives
    its params in full), so the canary-on-freeze automation always has a freeze name to render."""
    from deployments.register import SPECS
    from flows.stages import FreezeParams

    (spec,) = [s for s in SPECS if s["name"] == "freeze"]
    assert FreezeParams.model_validate(spec["parameters"]["params"]) == FreezeParams()

"""The automations' run parameters, rendered as Prefect's server renders them (hydration + Jinja), without a
server: the freeze-on-ready automation gives the freeze deployment one ``params`` object that the freeze
flow's model accepts, and the canary-on-freeze automation gives the canary one ``params`` object whose
freeze name it reads from the completed run's ``params``. (tests/flows/test_service.py and
test_canary_trigger.py run both through a real server.)"""

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
    candidate_set = "candidates-" + "ab" * 16  # a reference to the run's candidates, never every id
    payload = {"store_url": "sqlite:///x.db", "freeze_name": "team-v7", "quotas": quotas, "seed": 3,
               "candidate_set": candidate_set, "counts": {"train": 2}, "accepted": 2, "batches": 1}
    (action,) = automations.freeze_on_ready(str(uuid4())).actions
    rendered = _render(action.parameters, {"event": {"payload": payload}})

    assert list(rendered) == ["params"]  # one parameter: a run's params replaces the deployment's whole object
    assert rendered["params"] == {"name": "team-v7", "quotas": quotas, "seed": 3,
                                  "candidate_set": candidate_set}  # JSON types kept
    params = FreezeParams.model_validate(rendered["params"])
    assert params.quotas == SplitQuotas(**quotas) and params.candidate_set == candidate_set
    assert params.instance_ids is None
    assert params.out_dir is None  # the model's default, not a payload key


def test_canary_on_freeze_renders_one_params_object_with_the_freeze_name_of_the_completed_run():
    """The canary gets ``params`` with only ``freeze_name`` (the completed freeze run's ``params.name``); the
    run's params replace the deployment's whole object, and the model's defaults are the deployment's, so the
    canary still runs split ``test``, one trial at a time on the ``default`` profile."""
    from prefect.server.schemas.core import FlowRun

    from deployments.register import SPECS
    from flows.canary import CanaryParams
    from forgeflow.evaluation.canary_params import CanaryEndpoint, CanaryRunSettings

    (action,) = automations.canary_on_freeze(str(uuid4()), str(uuid4())).actions
    run = FlowRun(flow_id=uuid4(), parameters={"params": {"name": "trigger-v1", "seed": 0}})
    rendered = _render(action.parameters, {"flow_run": run})
    assert rendered == {"params": {"freeze_name": "trigger-v1"}}
    params = CanaryParams.model_validate(rendered["params"])
    assert params.freeze_name == "trigger-v1"
    assert (params.split, params.run, params.endpoint) == ("test", CanaryRunSettings(), CanaryEndpoint())
    (spec,) = [s for s in SPECS if s["name"] == "canary"]
    deployed = CanaryParams.model_validate(spec["parameters"]["params"])
    assert (params.run.concurrency, params.run.profile) == (deployed.run.concurrency, deployed.run.profile) == \
        (1, "default")
    assert params.model_copy(update={"freeze_name": deployed.freeze_name}) == deployed  # the rest: the same


def test_freeze_deployment_records_a_name_even_when_a_run_gives_no_params():
    """A run of the freeze deployment without parameters still records ``params.name`` (the deployment gives
    its params in full), so the canary-on-freeze automation always has a freeze name to render."""
    from deployments.register import SPECS
    from flows.stages import FreezeParams

    (spec,) = [s for s in SPECS if s["name"] == "freeze"]
    assert FreezeParams.model_validate(spec["parameters"]["params"]) == FreezeParams()

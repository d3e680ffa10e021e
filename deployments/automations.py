"""forgeflow's Prefect automations, in code (created by ``forgeflow up``, idempotently: replaced by name).

* ``forgeflow-freeze-on-ready``: a curate run's freeze-ready event runs the freeze deployment on its candidates.
* ``forgeflow-canary-on-freeze``: a completed freeze deployment run runs the canary deployment on that freeze.
* ``forgeflow-notify-on-failure``: a failed flow run posts to the given webhook (block ``forgeflow-failures``).

A run's ``params`` replaces the deployment's whole object, so the defaults that must hold live in the models.
"""

from __future__ import annotations

from typing import Any

from prefect.automations import Automation
from prefect.events.actions import RunDeployment, SendNotification
from prefect.events.schemas.automations import EventTrigger, Posture

FREEZE_READY_EVENT = "forgeflow.dataset.freeze-ready"
"""Mirrors flows.curate.FREEZE_READY_EVENT (not imported: that module pulls in the whole curate stack)."""
FREEZE_DEPLOYMENT = "freeze/freeze"
FREEZE_ON_READY = "forgeflow-freeze-on-ready"
CANARY_DEPLOYMENT = "canary/canary"
CANARY_ON_FREEZE = "forgeflow-canary-on-freeze"
NOTIFY_ON_FAILURE = "forgeflow-notify-on-failure"
NOTIFY_BLOCK_NAME = "forgeflow-failures"
FAILURE_BODY = ("Flow run {{ flow_run.name }} ({{ flow_run.id }}) of flow {{ flow.name }} failed: "
                "{{ flow_run.state.message }}")


def _from_payload(key: str) -> dict[str, Any]:
    """A RunDeployment parameter taken as JSON from the event's ``payload[key]`` (Prefect's hydration)."""
    return {"__prefect_kind": "json",
            "value": {"__prefect_kind": "jinja", "template": f"{{{{ event.payload.{key} | tojson }}}}"}}


FREEZE_PARAMETERS_FROM_PAYLOAD: dict[str, str] = {"name": "freeze_name", "quotas": "quotas", "seed": "seed",
                                                  "candidate_set": "candidate_set"}
"""field of the freeze flow's ``params`` (:class:`flows.stages.FreezeParams`) -> the freeze-ready event's
payload key it is rendered from."""

FREEZE_NAME_OF_COMPLETED_RUN = "{{ flow_run.parameters.params.name }}"
"""The canary's ``params.freeze_name``: the ``params.name`` of the freeze run whose completion fired the automation
(the freeze deployment gives its ``params`` in full, so a run that gives none still records a name)."""


def canary_run_parameters() -> dict[str, Any]:
    """The canary's run parameters: ``{"params": {"freeze_name": <the completed run's name>}}``."""
    return {"params": {"freeze_name": FREEZE_NAME_OF_COMPLETED_RUN}}


def freeze_run_parameters() -> dict[str, Any]:
    """The freeze's run parameters: each field of :data:`FREEZE_PARAMETERS_FROM_PAYLOAD` from the payload."""
    return {"params": {field: _from_payload(key) for field, key in FREEZE_PARAMETERS_FROM_PAYLOAD.items()}}


def freeze_on_ready(freeze_deployment_id: str) -> Automation:
    """The automation that runs the freeze deployment on each freeze-ready event."""
    return Automation(
        name=FREEZE_ON_READY,
        description=f"{FREEZE_READY_EVENT} -> run the {FREEZE_DEPLOYMENT} deployment with the curate run's "
                    "freeze_name, quotas, seed and candidates",
        trigger=EventTrigger(expect={FREEZE_READY_EVENT}, match={"prefect.resource.id": "*"},
                             posture=Posture.Reactive, threshold=1, within=0),
        actions=[RunDeployment(source="selected", deployment_id=freeze_deployment_id,
                               parameters=freeze_run_parameters())],
    )


def canary_on_freeze(freeze_deployment_id: str, canary_deployment_id: str) -> Automation:
    """The automation that runs the canary deployment when a freeze deployment run completes.

    The trigger matches ``prefect.flow-run.Completed`` events related to the freeze deployment; Prefect renders
    ``freeze_name`` from the emitting flow run (``RunDeployment.render_parameters``).
    """
    return Automation(
        name=CANARY_ON_FREEZE,
        description=f"a completed {FREEZE_DEPLOYMENT} run -> run the {CANARY_DEPLOYMENT} deployment on that freeze",
        trigger=EventTrigger(expect={"prefect.flow-run.Completed"},
                             match={"prefect.resource.id": "prefect.flow-run.*"},
                             match_related={"prefect.resource.id": f"prefect.deployment.{freeze_deployment_id}"},
                             posture=Posture.Reactive, threshold=1, within=0),
        actions=[RunDeployment(source="selected", deployment_id=canary_deployment_id,
                               parameters=canary_run_parameters())],
    )


def notify_on_failure(block_document_id: str) -> Automation:
    """The automation that sends a webhook notification for every failed flow run."""
    return Automation(
        name=NOTIFY_ON_FAILURE,
        description="a failed flow run -> a message through the forgeflow-failures webhook block",
        trigger=EventTrigger(expect={"prefect.flow-run.Failed"}, match={"prefect.resource.id": "prefect.flow-run.*"},
                             posture=Posture.Reactive, threshold=1, within=0),
        actions=[SendNotification(block_document_id=block_document_id, subject="forgeflow: flow run failed",
                                  body=FAILURE_BODY)],
    )


def save_notification_block(url: str) -> str:
    """Save (overwrite) the ``forgeflow-failures`` webhook block posting JSON to ``url``; its id."""
    from prefect.blocks.notifications import CustomWebhookNotificationBlock

    block = CustomWebhookNotificationBlock(name="forgeflow", url=url, method="POST",
                                           json_data={"subject": "{{subject}}", "body": "{{body}}"})
    return str(block.save(NOTIFY_BLOCK_NAME, overwrite=True))


def _replace(automation: Automation) -> str:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        for old in client.read_automations_by_name(automation.name):
            client.delete_automation(old.id)
    return str(automation.create().id)


def ensure_automations(deployments: dict[str, str], notify_url: str | None) -> dict[str, str]:
    """Create (or replace) forgeflow's automations; automation name -> id.

    Args:
        deployments: ``'flow/deployment'`` name -> deployment id, as registered.
        notify_url: None leaves that automation out (and deletes an old one).

    Raises:
        KeyError: the freeze or the canary deployment is not registered.
    """
    from prefect.client.orchestration import get_client

    for needed in (FREEZE_DEPLOYMENT, CANARY_DEPLOYMENT):
        if needed not in deployments:
            raise KeyError(f"deployment {needed!r} is not registered (have: {sorted(deployments)})")
    out = {FREEZE_ON_READY: _replace(freeze_on_ready(deployments[FREEZE_DEPLOYMENT])),
           CANARY_ON_FREEZE: _replace(canary_on_freeze(deployments[FREEZE_DEPLOYMENT],
                                                       deployments[CANARY_DEPLOYMENT]))}
    if notify_url:
        out[NOTIFY_ON_FAILURE] = _replace(notify_on_failure(save_notification_block(notify_url)))
    else:
        with get_client(sync_client=True) as client:
            for old in client.read_automations_by_name(NOTIFY_ON_FAILURE):
                client.delete_automation(old.id)
    return out

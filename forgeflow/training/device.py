"""Which device and dtype a burst trains in: one burst implementation for CPU and CUDA.

``auto`` (the default of :class:`forgeflow.training.burst.BurstConfig` and
:class:`forgeflow.training.rl.RLBurstConfig`) takes CUDA when ``torch.cuda.is_available()``, else
the CPU. On CUDA the model loads and trains in bfloat16 where the GPU supports it (``bf16=True``,
gradient checkpointing on, so activations of long agent samples fit); on the CPU in float32 with
``use_cpu=True``. The chosen device and dtype go into the adapter's lineage (``Lineage.device`` /
``Lineage.dtype``), and the merge of that adapter runs in the same dtype
(:func:`forgeflow.packaging.gguf.merge_adapter`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from forgeflow.common.errors import PreflightError

DeviceChoice = Literal["auto", "cpu", "cuda"]
"""What a burst config asks for."""


class DevicePlan(BaseModel):
    """The device a burst runs on.

    Attributes:
        device: ``cpu`` or ``cuda``.
        dtype: ``float32`` or ``bfloat16`` (the model's weights and the training precision).
        trainer_args: the ``transformers.TrainingArguments`` fields that follow from it
            (``use_cpu``, ``bf16``, ``fp16``, ``gradient_checkpointing``).
    """

    model_config = ConfigDict(frozen=True)

    device: Literal["cpu", "cuda"]
    dtype: Literal["float32", "bfloat16"]
    trainer_args: dict[str, Any]

    def torch_dtype(self) -> Any:
        """The ``torch.dtype`` of :attr:`dtype`."""
        import torch

        return getattr(torch, self.dtype)


def device_plan(requested: DeviceChoice = "auto", cuda_available: bool | None = None,
                bf16_supported: bool | None = None) -> DevicePlan:
    """The :class:`DevicePlan` for ``requested`` on this machine.

    Args:
        requested: ``auto`` (CUDA when available), ``cpu`` or ``cuda``.
        cuda_available / bf16_supported: the machine's answers (default: ``torch.cuda.is_available()``
            and ``torch.cuda.is_bf16_supported()``); given explicitly by tests.

    Raises:
        PreflightError: ``cuda`` was asked for and CUDA is not available (nothing is loaded).
    """
    if cuda_available is None or (bf16_supported is None and cuda_available):
        import torch

        if cuda_available is None:
            cuda_available = torch.cuda.is_available()
        if bf16_supported is None and cuda_available:
            bf16_supported = torch.cuda.is_bf16_supported()
    if requested == "cuda" and not cuda_available:
        raise PreflightError("device 'cuda' was asked for but torch.cuda.is_available() is False "
                             "(no GPU, or a CPU build of torch)")
    if requested == "cpu" or not cuda_available:
        return DevicePlan(device="cpu", dtype="float32", trainer_args={
            "use_cpu": True, "bf16": False, "fp16": False, "gradient_checkpointing": False})
    bf16 = bool(bf16_supported)
    return DevicePlan(device="cuda", dtype="bfloat16" if bf16 else "float32", trainer_args={
        "use_cpu": False, "bf16": bf16, "fp16": False, "gradient_checkpointing": True})

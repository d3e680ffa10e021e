"""Which device and dtype a burst trains in: CUDA in bfloat16 where supported, else the CPU in float32
(the lineage records it; the merge uses the same dtype).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from forgeflow.common.errors import PreflightError
from forgeflow.training.attention import (
    VARLEN_ATTENTION,
    choose_attention,
    flash_attn_installed,
    register_torch_varlen_attention,
    torch_varlen_available,
)

DeviceChoice = Literal["auto", "cpu", "cuda"]
"""What a burst config asks for."""


class DevicePlan(BaseModel):
    """The device a burst runs on."""

    model_config = ConfigDict(frozen=True)

    device: Literal["cpu", "cuda"]
    dtype: Literal["float32", "bfloat16"] = Field(description="the model's weights and the training precision")
    trainer_args: dict[str, Any] = Field(
        description="TrainingArguments fields that follow (use_cpu, bf16, fp16, activation_checkpointing)")
    attention: Literal["sdpa", "flash_attention_2", "torch_varlen"] = Field("sdpa",
        description="attn_implementation of an SFT burst (RL bursts keep transformers' default: padded batches)")

    def torch_dtype(self) -> Any:
        """The ``torch.dtype`` of :attr:`dtype`."""
        import torch

        return getattr(torch, self.dtype)

    def model_kwargs(self) -> dict[str, Any]:
        """``from_pretrained`` keyword arguments (``dtype``, ``attn_implementation``; registers ``torch_varlen``).

        Raises:
            RuntimeError: the plan names ``torch_varlen`` and this torch lacks ``varlen_attn``.
        """
        if self.attention == VARLEN_ATTENTION:
            register_torch_varlen_attention()
        return {"dtype": self.torch_dtype(), "attn_implementation": self.attention}


def device_plan(requested: DeviceChoice = "auto", cuda_available: bool | None = None,
                bf16_supported: bool | None = None, flash_attn: bool | None = None,
                torch_varlen: bool | None = None) -> DevicePlan:
    """The :class:`DevicePlan` for ``requested`` (``auto``, ``cpu`` or ``cuda``) on this machine.

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
        return DevicePlan(device="cpu", dtype="float32", attention="sdpa", trainer_args={
            "use_cpu": True, "bf16": False, "fp16": False, "activation_checkpointing": False})
    dtype = "bfloat16" if bf16_supported else "float32"
    if flash_attn is None:
        flash_attn = flash_attn_installed()
    if torch_varlen is None:
        torch_varlen = torch_varlen_available()
    return DevicePlan(device="cuda", dtype=dtype, attention=choose_attention("cuda", dtype, flash_attn, torch_varlen),
                      trainer_args={"use_cpu": False, "bf16": dtype == "bfloat16", "fp16": False,
                                    "activation_checkpointing": True})

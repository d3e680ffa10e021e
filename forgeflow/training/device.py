"""Which device and dtype a burst trains in: one burst implementation for CPU and CUDA.

``auto`` (the default of :class:`forgeflow.training.burst.BurstConfig` and
:class:`forgeflow.training.rl.RLBurstConfig`) takes CUDA when ``torch.cuda.is_available()``, else
the CPU. On CUDA the model loads and trains in bfloat16 where the GPU supports it (``bf16=True``,
gradient checkpointing on, so activations of long agent samples fit; an SFT burst turns it off where a
step's activations fit the GPU's free memory, :func:`forgeflow.training.burst.resolve_checkpointing`);
on the CPU in float32 with ``use_cpu=True``. The plan also names the attention implementation an SFT
burst's padding-free (packed) batches need on that device (:func:`forgeflow.training.attention.choose_attention`:
``flash_attention_2`` or PyTorch's varlen FlashAttention on CUDA in bf16, SDPA otherwise). The chosen
device, dtype and attention go into the adapter's lineage (``Lineage.device`` / ``Lineage.dtype`` /
``Lineage.attention``), and the merge of that adapter runs in the same dtype
(:func:`forgeflow.packaging.gguf.merge_adapter`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

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
    """The device a burst runs on.

    Attributes:
        device: ``cpu`` or ``cuda``.
        dtype: ``float32`` or ``bfloat16`` (the model's weights and the training precision).
        trainer_args: the ``transformers.TrainingArguments`` fields that follow from it
            (``use_cpu``, ``bf16``, ``fp16``, ``activation_checkpointing``: transformers 5's name for gradient
            checkpointing, whose ``gradient_checkpointing`` is a deprecated alias).
        attention: the ``attn_implementation`` an SFT burst loads its model with
            (``flash_attention_2``, ``torch_varlen`` or ``sdpa``;
            :func:`forgeflow.training.attention.choose_attention`). RL bursts keep transformers'
            default: their batches are padded, not packed.
    """

    model_config = ConfigDict(frozen=True)

    device: Literal["cpu", "cuda"]
    dtype: Literal["float32", "bfloat16"]
    trainer_args: dict[str, Any]
    attention: Literal["sdpa", "flash_attention_2", "torch_varlen"] = "sdpa"

    def torch_dtype(self) -> Any:
        """The ``torch.dtype`` of :attr:`dtype`."""
        import torch

        return getattr(torch, self.dtype)

    def model_kwargs(self) -> dict[str, Any]:
        """``from_pretrained`` / ``from_config`` keyword arguments of this plan: ``dtype`` and
        ``attn_implementation``. Registers :data:`~forgeflow.training.attention.VARLEN_ATTENTION`
        with transformers first when the plan uses it.

        Raises:
            RuntimeError: the plan names ``torch_varlen`` and this torch lacks ``varlen_attn``.
        """
        if self.attention == VARLEN_ATTENTION:
            register_torch_varlen_attention()
        return {"dtype": self.torch_dtype(), "attn_implementation": self.attention}


def device_plan(requested: DeviceChoice = "auto", cuda_available: bool | None = None,
                bf16_supported: bool | None = None, flash_attn: bool | None = None,
                torch_varlen: bool | None = None) -> DevicePlan:
    """The :class:`DevicePlan` for ``requested`` on this machine.

    Args:
        requested: ``auto`` (CUDA when available), ``cpu`` or ``cuda``.
        cuda_available / bf16_supported: the machine's answers (default: ``torch.cuda.is_available()``
            and ``torch.cuda.is_bf16_supported()``); given explicitly by tests.
        flash_attn / torch_varlen: whether ``flash_attn`` is importable and this torch has
            ``varlen_attn`` (default: :func:`~forgeflow.training.attention.flash_attn_installed`,
            :func:`~forgeflow.training.attention.torch_varlen_available`; asked only on CUDA).

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

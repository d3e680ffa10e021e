"""SFT bursts on an image-text-to-text base (a language model with a vision tower, e.g. Qwen3.5 / tiny-vl).

Vision tower frozen (digested before and after), LoRA on the language model only, no video processor
(transformers 5.23 builds it with torchvision, absent here), unpacked rows; the loss stays on assistant
tokens through :data:`VL_TRAINING_TEMPLATE`, used only where it renders as the checkpoint's own.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from forgeflow.common.errors import InputError
from forgeflow.training import sample_images
from forgeflow.training.adapters import LoraSettings
from forgeflow.training.health import BurstHealthError, HealthReport

VL_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                   "in_proj_qkv", "in_proj_z", "out_proj")
"""The language model's linear modules a VL burst adapts by default: full attention, MLP and the
linear-attention (Gated DeltaNet) input/output projections of Qwen3.5."""

DEFAULT_TEXT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
""":class:`~forgeflow.training.adapters.LoraSettings`' default targets: on a VL base they mean
:data:`VL_LORA_TARGETS`."""

VL_TRAINING_TEMPLATE = """{%- for message in messages %}
    {%- if loop.first and message['role'] != 'system' %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
    {{- '<|im_start|>' + message['role'] + '\\n' }}
    {%- if message['role'] == 'assistant' %}{% generation %}
    {%- if message['content'] is string %}
        {{- message['content'] }}
    {%- else %}
        {%- for part in message['content'] %}
            {%- if 'text' in part and part['text'] is not none %}
                {{- part['text'] }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
    {{- '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}
    {%- else %}
    {%- if message['content'] is string %}
        {{- message['content'] }}
    {%- else %}
        {%- for part in message['content'] %}
            {%- if part['type'] == 'image' or 'image' in part or 'image_url' in part %}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' }}
            {%- elif part['type'] == 'video' or 'video' in part %}
                {{- '<|vision_start|><|video_pad|><|vision_end|>' }}
            {%- elif 'text' in part %}
                {{- part['text'] }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
    {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
"""The tiny-vl / Qwen2-VL chat template (``forgeflow.packaging.vl_model.VL_CHAT_TEMPLATE``) with each assistant
turn's text and ``<|im_end|>`` inside ``{% generation %}``: ``return_assistant_tokens_mask`` marks exactly
what the burst learns (transformers' chat templating docs, "Training" / assistant masks)."""

_PROBE = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is drawn?"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "A red square."}]},
    {"role": "user", "content": [{"type": "text", "text": "And now?"}]},
    {"role": "assistant", "content": "Still red."},
]


def _config(base_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((Path(base_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InputError(f"{base_dir} holds no readable config.json: {exc}") from exc


def is_image_text_model(base_dir: Path) -> bool:
    """True when ``base_dir/config.json`` has a ``vision_config`` (an image-text-to-text checkpoint).

    Raises:
        InputError: no readable ``config.json``.
    """
    return isinstance(_config(base_dir).get("vision_config"), dict)


def vl_targets(configured: Sequence[str]) -> tuple[str, ...]:
    """The module names a VL burst adapts: :data:`VL_LORA_TARGETS` for the default targets, else ``configured``."""
    return VL_LORA_TARGETS if tuple(configured) == DEFAULT_TEXT_TARGETS else tuple(configured)


def language_model_pattern(targets: Sequence[str]) -> str:
    """peft's ``target_modules`` regex (matched against whole module names) for ``targets`` inside the
    language model only (names containing ``language_model.``; the vision tower's never do)."""
    names = "|".join(sorted(set(targets)))
    return rf".*language_model\..*\.(?:{names})"


def vl_lora_config(lora_r: int, lora_alpha: int, lora_dropout: float, targets: Sequence[str]) -> Any:
    """``peft.LoraConfig`` of a VL burst: :func:`language_model_pattern` of :func:`vl_targets`."""
    from peft import LoraConfig

    return LoraConfig(r=lora_r, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
                      target_modules=language_model_pattern(vl_targets(targets)), task_type="CAUSAL_LM")


def vl_lora_parameter_count(base_dir: Path, lora_r: int, targets: Sequence[str]) -> int:
    """Trainable LoRA parameters of a VL burst: ``r * (in + out)`` per adapted linear layer (Hu et al. 2021).

    Shapes from ``text_config``: Qwen3.5's gated full attention has ``q_proj`` twice the heads' width;
    Gated DeltaNet's ``in_proj_qkv`` maps to 2 key + 1 value widths, ``in_proj_z``/``out_proj`` the value width.

    Raises:
        InputError: no readable ``config.json`` or no ``text_config``.
    """
    text = _config(base_dir).get("text_config")
    if not isinstance(text, dict):
        raise InputError(f"{base_dir}/config.json has no text_config")
    hidden, inter = int(text["hidden_size"]), int(text["intermediate_size"])
    heads = int(text["num_attention_heads"])
    head_dim = int(text.get("head_dim") or hidden // heads)
    kv = int(text.get("num_key_value_heads", heads)) * head_dim
    keys = int(text.get("linear_num_key_heads", 0)) * int(text.get("linear_key_head_dim", 0))
    values = int(text.get("linear_num_value_heads", 0)) * int(text.get("linear_value_head_dim", 0))
    full = {"q_proj": (hidden, 2 * heads * head_dim), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
            "o_proj": (heads * head_dim, hidden)}
    linear = {"in_proj_qkv": (hidden, 2 * keys + values), "in_proj_z": (hidden, values), "out_proj": (values, hidden)}
    mlp = {"gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    layer_types = text.get("layer_types") or ["full_attention"] * int(text["num_hidden_layers"])
    total = 0
    for kind in layer_types:
        shapes = {**mlp, **(linear if kind == "linear_attention" else full)}
        total += sum(lora_r * sum(shapes[m]) for m in vl_targets(targets) if m in shapes)
    return total


def vision_tower_sha256(hf_dir: Path) -> str:
    """sha256 over a checkpoint's vision tower, the scheme of ``forgeflow.packaging.vl_model.vision_tower_sha256``.

    Raises:
        InputError: no safetensors file, or no vision tensor in them.
    """
    from safetensors import safe_open

    files = sorted(Path(hf_dir).glob("*.safetensors"))
    if not files:
        raise InputError(f"{hf_dir} holds no safetensors file")
    where: dict[str, tuple[Path, str]] = {}  # tower name -> (file, tensor name): read one at a time below
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                if "visual." in name:
                    where[name.split("visual.", 1)[1]] = (file, name)
    if not where:
        raise InputError(f"{hf_dir} has no vision tower tensors (no safetensors tensor named with 'visual.')")

    def read(key: str) -> Any:  # one tensor in memory at a time
        file, name = where[key]
        with safe_open(str(file), framework="pt") as handle:
            return handle.get_tensor(name)

    return _tensors_sha256(where, read)


def vision_state_sha256(model: Any) -> str:
    """:func:`vision_tower_sha256`'s scheme over a loaded model's ``visual.`` tensors, in memory dtype.

    Raises:
        InputError: the model has no ``visual.`` tensor.
    """
    tensors = {name.split("visual.", 1)[1]: t.detach().cpu() for name, t in model.state_dict().items()
               if "visual." in name}
    if not tensors:
        raise InputError("the model has no vision tower tensors (no state_dict name with 'visual.')")
    return _tensors_sha256(tensors, tensors.__getitem__)


def _tensors_sha256(keys: Iterable[str], get: Callable[[str], Any]) -> str:
    """sha256 over ``get(key)`` for the sorted ``keys``: each key, dtype and shape, then the tensor's bytes."""
    import torch

    digest = hashlib.sha256()
    for key in sorted(keys):
        tensor = get(key).contiguous()
        digest.update(f"{key}|{tensor.dtype}|{tuple(tensor.shape)}\n".encode())
        digest.update(tensor.view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def load_vl_model(base_dir: Path, model_kwargs: dict[str, Any]) -> Any:
    """``AutoModelForImageTextToText`` of ``base_dir``, its vision tower (``visual.`` parameters) frozen.

    Raises:
        InputError: the model has no ``visual.`` parameter.
    """
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(str(base_dir), **model_kwargs)
    frozen = [p.requires_grad_(False) for name, p in model.named_parameters() if "visual." in name]
    if not frozen:
        raise InputError(f"{base_dir}: the image-text-to-text model has no vision tower parameters ('visual.')")
    return model


def vl_processor(base_dir: Path) -> Any:
    """The checkpoint's image processor and tokenizer (no video processor), with :func:`training_template` set.

    Raises:
        InputError: the processor class is not Qwen2-VL / Qwen2.5-VL / Qwen3-VL's, or the template is refused.
    """
    import transformers
    from transformers import AutoImageProcessor, AutoTokenizer

    config = json.loads((Path(base_dir) / "processor_config.json").read_text(encoding="utf-8")) \
        if (Path(base_dir) / "processor_config.json").is_file() else {}
    name = config.get("processor_class", "Qwen3VLProcessor")
    if name not in ("Qwen2VLProcessor", "Qwen2_5_VLProcessor", "Qwen3VLProcessor"):
        raise InputError(f"{base_dir}: processor class {name} is not one a VL burst builds (Qwen2/2.5/3-VL)")
    parent = getattr(transformers, name)

    class _ImageTextProcessor(parent):  # type: ignore[misc, valid-type]
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument_name == "video_processor" and argument is None:
                return None  # no videos in a burst: the video processor (torchvision) is left out
            return super().check_argument_for_proper_class(argument_name, argument)

    tokenizer = AutoTokenizer.from_pretrained(str(base_dir))
    processor = _ImageTextProcessor(image_processor=AutoImageProcessor.from_pretrained(str(base_dir)),
                                    tokenizer=tokenizer, video_processor=None, chat_template=tokenizer.chat_template)
    processor.chat_template = training_template(processor)
    return processor


def training_template(processor: Any) -> str:
    """The processor's template if it has ``{% generation %}`` markers, else :data:`VL_TRAINING_TEMPLATE` if equal.

    Raises:
        InputError: no chat template, or it renders :data:`_PROBE` differently (add generation markers).
    """
    own = processor.chat_template or getattr(processor.tokenizer, "chat_template", None)
    if not own:
        raise InputError("the base checkpoint's processor has no chat template")
    if "{% generation %}" in own or "{%- generation %}" in own:
        return own
    rendered = [processor.apply_chat_template(_PROBE, chat_template=t, tokenize=False)
                for t in (own, VL_TRAINING_TEMPLATE)]
    if rendered[0] != rendered[1]:
        raise InputError("the base checkpoint's chat template has no {% generation %} markers and is not the "
                         "Qwen2-VL template forgeflow marks (probe rendered differently): assistant-only loss "
                         "needs a template with generation markers")
    return VL_TRAINING_TEMPLATE


def vl_dataset(rows: list[dict[str, Any]]) -> Any:
    """A TRL vision dataset of checked SFT rows: image placeholders, and an ``images`` column (PIL, RGB).

    Raises:
        InputError: an image file no longer has its recorded sha256, or does not decode.
    """
    from datasets import Dataset
    from PIL import Image

    out = []
    for row in rows:
        images: list[Any] = []

        def parts(content: Any, images: list[Any] = images) -> list[dict[str, Any]]:
            if isinstance(content, str):
                return [{"type": "text", "text": content}]
            result = []
            for part in content:
                if part.get("type") == "image":
                    path = Path(part["image"])
                    sample_images.check_image(path, part["image"], part.get("sha256"))
                    with Image.open(path) as image:
                        images.append(image.convert("RGB"))
                    result.append({"type": "image", "text": None})
                else:
                    result.append({"type": "text", "text": part["text"]})
            return result

        item = {key: [{**m, "content": parts(m["content"])} for m in row[key]]
                for key in ("messages", "prompt", "completion") if key in row}
        out.append({**item, "images": images})
    return Dataset.from_list(out)


def check_vl_lengths(processor: Any, dataset: Any, max_length: int) -> None:
    """Refuse rows longer than ``max_length`` tokens with their image tokens expanded.

    Raises:
        InputError: how many rows do not fit, the longest's token count and the first five (index, tokens).
    """
    too_long = []
    for index, row in enumerate(dataset):
        messages = row["messages"] if "messages" in row else [*row["prompt"], *row["completion"]]
        from trl.data_utils import prepare_multimodal_messages

        filled = prepare_multimodal_messages([{**m, "content": [{k: v for k, v in p.items() if v is not None}
                                                                 for p in m["content"]]} for m in messages],
                                             images=row["images"])
        ids = processor.apply_chat_template(filled, tokenize=True, return_dict=True)["input_ids"]
        n_tokens = len(ids[0]) if ids and isinstance(ids[0], list) else len(ids)
        if n_tokens > max_length:
            too_long.append((index, n_tokens))
    if too_long:
        named = ", ".join(f"row {i} ({n} tokens)" for i, n in too_long[:5])
        raise InputError(f"{len(too_long)} of {len(dataset)} SFT samples exceed max_length={max_length} tokens with "
                         f"their image tokens (the longest has {max(n for _, n in too_long)}: give max_length at "
                         f"least that): {named}")


class VLBurstInputs(BaseModel):
    """What a VL burst trains (:func:`prepare_vl_burst`)."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    model: Any = Field(description="the peft model, vision tower frozen")
    processor: Any
    dataset: Any
    vision_tower_sha256: str = Field(min_length=64, max_length=64,
        description="vision_tower_sha256 of the base checkpoint (recorded in the lineage)")
    state_sha256: str = Field(min_length=64, max_length=64,
        description="vision_state_sha256 of the loaded tower before training")


def prepare_vl_burst(base_dir: Path, rows: list[dict[str, Any]], lora: LoraSettings, max_length: int,
                     model_kwargs: dict[str, Any], parent_adapter_dir: Path | None) -> VLBurstInputs:
    """Processor, dataset, model (tower frozen, LoRA on the language model) of a VL burst.

    Raises:
        InputError: the processor, template, images or lengths (image tokens included) are refused.
    """
    from peft import PeftModel, get_peft_model

    processor = vl_processor(base_dir)
    columns = ("messages",) if rows and "messages" in rows[0] else ("prompt", "completion")
    dataset = vl_dataset([{key: row[key] for key in columns} for row in rows])
    check_vl_lengths(processor, dataset, max_length)
    model = load_vl_model(base_dir, model_kwargs)
    before = vision_state_sha256(model)
    if parent_adapter_dir is None:
        model = get_peft_model(model, vl_lora_config(lora.lora_r, lora.lora_alpha, lora.lora_dropout,
                                                     lora.lora_target_modules))
    else:
        model = PeftModel.from_pretrained(model, str(parent_adapter_dir), is_trainable=True)
    adapted_vision = [name for name, p in model.named_parameters() if "visual." in name and p.requires_grad]
    if adapted_vision:
        raise InputError(f"the adapter would train vision tower parameters: {adapted_vision[:5]}")
    return VLBurstInputs(model=model, processor=processor, dataset=dataset,
                         vision_tower_sha256=vision_tower_sha256(base_dir), state_sha256=before)


def check_tower_unchanged(model: Any, inputs: VLBurstInputs, report: HealthReport) -> None:
    """After training: the vision tower's tensors still have :attr:`VLBurstInputs.state_sha256`.

    Raises:
        BurstHealthError: the tower changed (no adapter is written).
    """
    after = vision_state_sha256(model)
    if after != inputs.state_sha256:
        raise BurstHealthError(f"the vision tower changed during the burst ({inputs.state_sha256} -> {after}); "
                               "it must stay frozen", report)

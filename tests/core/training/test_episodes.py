"""Episode tokens without a sandbox: the prefix check, turns appended by concatenation (equal to the chat
template's rendering when the samples are canonical), the ``episode`` block's validation, and the figure of
reward and turns per step."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from forgeflow.common.errors import InputError
from forgeflow.common.settings import cache_dir
from forgeflow.packaging.base_model import build_tiny_model
from forgeflow.training.episodes import EpisodeSettings, EpisodeTokens, ScriptedPolicy, prefix_mismatch
from forgeflow.training.episodes_grpo import EpisodeStepStats
from forgeflow.training.episodes_plot import episode_plot_markdown
from forgeflow.training.rl import RLBurstConfig


def test_turns_concatenate_to_the_templates_rendering_and_the_prefix_check_finds_a_departure() -> None:
    from transformers import AutoTokenizer

    tiny = build_tiny_model(cache_dir() / "test-fixtures" / "tiny-seed0" / "hf", seed=0).path
    tokens = EpisodeTokens(AutoTokenizer.from_pretrained(str(tiny)))
    messages = [{"role": "user", "content": "fix add"}]
    answers = ["```mswea_bash_command\nls\n```", "```mswea_bash_command\ncat calc.py\n```"]
    policy = ScriptedPolicy(tokens, answers)
    stored = tokens.prompt_ids(messages)
    for i, observation in enumerate(["calc.py tests", "def add(a, b): ..."]):
        sample = policy.sample(stored, messages)
        assert prefix_mismatch(stored, sample.context_ids) is None
        stored = stored + sample.completion_ids + tokens.tool_ids(observation, sample.completion_ids)
        messages = [*messages, {"role": "assistant", "content": answers[i]}, {"role": "user", "content": observation}]
        assert stored == tokens.prompt_ids(messages)  # canonical samples: concatenation == the template's render
    # a sample cut before its eos gets the turn's eos appended (masked by the runner), never re-tokenized
    assert tokens.tool_ids("out", [1, 2])[0] == tokens.eos_id and tokens.tool_ids("out", [1, tokens.eos_id])[0] != \
        tokens.eos_id
    split = ScriptedPolicy(tokens, answers, split_tokens=True, retokenize_history=True)
    first = split.sample(tokens.prompt_ids(messages[:1]), messages[:1])
    after = [*messages[:1], {"role": "assistant", "content": answers[0]}, {"role": "user", "content": "x"}]
    ours = tokens.prompt_ids(messages[:1]) + first.completion_ids + tokens.tool_ids("x", first.completion_ids)
    where = prefix_mismatch(ours, split.sample(ours, after).context_ids)
    assert where == len(tokens.prompt_ids(messages[:1]))  # departs at the first re-tokenized sampled token
    assert prefix_mismatch([1, 2, 3], [1, 2]) == 2 and prefix_mismatch([1, 2], [1, 2, 3]) == 2
    with pytest.raises(ValidationError, match="bash"):
        EpisodeSettings(tools=("submit",))
    with pytest.raises(ValidationError, match="grpo"):
        RLBurstConfig(algorithm="rloo", episode=EpisodeSettings())
    assert "episode" not in RLBurstConfig().model_dump()  # single-turn bursts keep their lineage's inputs


def test_the_plot_of_reward_and_turns_is_a_png_inline_and_on_disk(tmp_path) -> None:
    import base64

    stats = [EpisodeStepStats(step=1, episodes=4, resolved=1, unresolved=2, exceptions=1, turns=12, turns_max=5,
                              reward_mean=1 / 3),
             EpisodeStepStats(step=2, episodes=4, exceptions=4, turns=3, turns_max=1)]  # none scored
    markdown = episode_plot_markdown(stats, tmp_path / "run" / "episodes.png")
    inline = base64.b64decode(markdown.split("data:image/png;base64,")[1].split(")")[0])
    assert inline == (tmp_path / "run" / "episodes.png").read_bytes() and inline[:4] == b"\x89PNG"
    assert "2 step(s), 8 episode(s): 1 resolved, 5 exception(s), 15 turn(s)" in markdown
    with pytest.raises(InputError, match="no episode steps"):
        episode_plot_markdown([], tmp_path / "none.png")

"""A prompt's token ids as the policy sees them: the prompt text as it is, or, with the spec's
`chat_template`, a user message (after an optional system message) rendered by the model's chat
template with the generation prompt after it (transformers' `apply_chat_template`, imported only
then).

The rendered text holds the template's special tokens as text; it is encoded without adding
special tokens again, as `apply_chat_template(tokenize=True)` does.

Multi-turn episodes (`core.episodes`): an environment's observation after a model turn is
rendered the same way, as what the template puts between the model's turn and its next one
(`observation`): the end of the assistant's turn that the model did not write itself, the
observation as a tool or user message, and the generation prompt. The run's tools go to the
template (`tools=[...]`, as transformers takes them) with every rendering.
"""

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from services.contracts.runspec import shorten_path
from services.tasks.base import TaskError

CONFIG_MAX_BYTES = 16 * 1024 * 1024
TURN = "\x00spotrl-model-turn\x00"  # stands for a model turn's text in a rendering


def has_chat_template(model_dir: str | Path) -> bool:
    """Whether the model folder ships a chat template (chat_template.jinja or .json, or a
    `chat_template` in tokenizer_config.json), without loading its tokenizer."""
    folder = Path(model_dir)
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    config = folder / "tokenizer_config.json"
    try:
        if config.stat().st_size > CONFIG_MAX_BYTES:
            return False
        return bool(json.loads(config.read_bytes()).get("chat_template"))
    except (OSError, ValueError, AttributeError):  # missing, not JSON, not an object
        return False


def no_template_error(model_dir: str | Path) -> TaskError:
    return TaskError(
        f"model {shorten_path(model_dir)} has no chat template (tokenizer_config.json "
        "chat_template or chat_template.jinja): run without chat_template"
    )


class PromptEncoder:
    def __init__(
        self,
        model_dir: str | Path,
        tokenizer: Tokenizer,
        chat_template: bool = False,
        system_prompt: str | None = None,
        tools: list[dict] | None = None,
    ) -> None:
        self.tokenizer, self.system_prompt = tokenizer, system_prompt
        # OpenAI/HF function tools, for the chat template (which also takes functions)
        self.tools: list[dict | Callable[..., Any]] | None = list(tools) if tools else None
        self.chat = None
        if chat_template:
            if not has_chat_template(model_dir):
                raise no_template_error(model_dir)
            from transformers import AutoTokenizer

            self.chat = AutoTokenizer.from_pretrained(str(model_dir))
            if not self.chat.chat_template:
                raise no_template_error(model_dir)

    def text(self, prompt: str) -> str:
        """What the model is given as text."""
        if self.chat is None:
            return prompt
        return self._render(self._opening(prompt), True)

    def _opening(self, prompt: str) -> list[dict]:
        messages = [{"role": "user", "content": prompt}]
        if self.system_prompt is not None:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        assert self.chat is not None
        rendered = self.chat.apply_chat_template(
            messages, tools=self.tools, add_generation_prompt=generation_prompt, tokenize=False
        )
        return str(rendered)

    def observation(self, role: str, content: str, stop_text: str) -> str:
        """The text that follows a model turn which ended with `stop_text` (its stop token as
        text; "" when the token budget cut it): the observation as it is, or with a chat
        template, the rest of the assistant's turn end, the observation as a `role` message
        and the generation prompt of the next turn."""
        if self.chat is None:
            return content
        before = [*self._opening("?"), {"role": "assistant", "content": TURN}]
        head = self._render(before, False)
        full = self._render([*before, {"role": role, "content": content}], True)
        if TURN not in head or not full.startswith(head):
            raise TaskError(
                "the model's chat template renders a conversation's past turns differently "
                "once a message follows them: it cannot carry a multi-turn episode"
            )
        end = head[head.index(TURN) + len(TURN) :]  # what closes the assistant's turn
        if stop_text and end.startswith(stop_text):
            end = end[len(stop_text) :]  # the model wrote that part itself
        return end + full[len(head) :]

    def encode_observation(self, role: str, content: str, stop_text: str) -> list[int]:
        """Token ids of `observation` (no special tokens added: the template's are text)."""
        text = self.observation(role, content, stop_text)
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode(self, prompts: list[str]) -> list[list[int]]:
        """Token ids of each prompt (CPU-bound: the coordinator runs it in a thread)."""
        if self.chat is None:
            return [e.ids for e in self.tokenizer.encode_batch(prompts)]
        texts = [self.text(p) for p in prompts]
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

"""Process reward models (PRMs): Hugging Face checkpoints that score each reasoning step, loaded
frozen for the `process` reward (`omgrpo.core.process`).

Two checkpoint formats (`reward.prm.format`):
- `causal_lm`: a language model that, right after a step's tag, predicts a "good" or a "bad"
  token (Math-Shepherd: tag ` ки`, tokens `+` / `-`); a step's score is
  softmax(logit_good, logit_bad)[good] at the tag's token.
- `token_classification`: a classification head over every token (`AutoModelForTokenClassification`,
  PURE-PRM style; the toy PRM); a step's score is softmax(logits)[good_label] at the tag's token.

A (question, response) is rendered with the PRM's chat template (user: the question, assistant:
each step followed by the step tag) and scored at the token holding the tag's last non-blank
character, found through the tokenizer's offset mapping, so any tokenization of the tag works.
The PRM never trains: eval mode, no gradient, its own object outside the policy's optimizer.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    AutoTokenizer,
    PreTrainedTokenizerBase,
)

from omgrpo.console import quiet_library_bars
from omgrpo.core.process import StepScores, score_within_budget, split_steps

PRM_FORMATS = ("causal_lm", "token_classification")
PRM_META = "omgrpo_prm.json"
"""A PRM directory's own settings (format, step tag, separator, ...), written by the toy PRM."""
_SETTING_KEYS = ("format", "step_tag", "separator")


@dataclass(frozen=True)
class PrmSettings:
    """How a PRM reads a response (`reward.prm`, completed from the checkpoint's own file)."""

    format: str
    step_tag: str = "\n"
    separator: str = "\n"
    good_token: str = "+"
    bad_token: str = "-"
    good_label: int = 1
    chat_template: bool = True
    system: str | None = None

    @classmethod
    def resolve(cls, prm_cfg: Any, path: str | Path) -> PrmSettings:
        """`reward.prm`'s keys; a null `format`, `step_tag` or `separator` comes from the
        checkpoint's `omgrpo_prm.json`, else the defaults (a newline for both)."""
        meta_path = Path(path) / PRM_META
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        own = {k: prm_cfg[k] if prm_cfg[k] is not None else meta.get(k) for k in _SETTING_KEYS}
        if own["format"] not in PRM_FORMATS:
            where = f"{meta_path}" if meta_path.exists() else "reward.prm.format"
            raise ValueError(
                f"{where}: PRM format {own['format']!r}; set reward.prm.format to one of "
                f"{', '.join(PRM_FORMATS)}"
            )
        return cls(
            format=own["format"],
            step_tag=own["step_tag"] if own["step_tag"] is not None else "\n",
            separator=own["separator"] if own["separator"] is not None else "\n",
            good_token=prm_cfg.good_token,
            bad_token=prm_cfg.bad_token,
            good_label=int(prm_cfg.good_label),
            chat_template=bool(prm_cfg.chat_template),
            system=prm_cfg.system,
        )


class ProcessRewardModel:
    """A frozen PRM with its tokenizer: `score_batch` scores (question, steps) pairs; calling it
    on (questions, responses) splits each response into steps and scores within the budget
    (`omgrpo.core.process.ProcessScorer`)."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        settings: PrmSettings,
        batch_size: int = 64,
        budget_s: float = math.inf,
    ):
        if not tokenizer.is_fast:
            raise ValueError("a PRM needs a fast tokenizer (offset mappings place the step tags)")
        self.model = model.eval().requires_grad_(False)
        self.tokenizer, self.settings = tokenizer, settings
        self.batch_size, self.budget_s = batch_size, budget_s
        self.pad_id = tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
        self.candidates: list[int] | None = None
        if settings.format == "causal_lm":
            self.candidates = [self._single_token(settings.good_token, "good_token")]
            self.candidates.append(self._single_token(settings.bad_token, "bad_token"))
        tag = settings.step_tag
        if not tag:
            raise ValueError("reward.prm.step_tag must be non-empty")
        # the character a step is scored at: the tag's last non-blank one (` ки` -> `и`)
        self._mark = len(tag.rstrip()) - 1 if tag.strip() else len(tag) - 1

    def _single_token(self, text: str, key: str) -> int:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise ValueError(f"reward.prm.{key} {text!r} is {len(ids)} tokens for this PRM; need 1")
        return ids[0]

    def render(self, question: str, steps: list[str]) -> tuple[str, list[int]]:
        """The PRM's input text and, per step, the character its score is read at (the tag's
        last non-blank character after that step)."""
        s, tag = self.settings, self.settings.step_tag
        content = "".join(step + tag for step in steps)
        templated = s.chat_template and getattr(self.tokenizer, "chat_template", None)
        if templated:
            system = [{"role": "system", "content": s.system}] if s.system else []
            messages = [
                *system,
                {"role": "user", "content": question},
                {"role": "assistant", "content": content},
            ]
            text = self.tokenizer.apply_chat_template(messages, tokenize=False)
            base = text.rfind(content)
            if base < 0:
                raise ValueError(
                    "the PRM's chat template changes the assistant text; set "
                    "reward.prm.chat_template=false"
                )
        else:
            text, base = question + "\n" + content, len(question) + 1
        marks, pos = [], base
        for step in steps:
            marks.append(pos + len(step) + self._mark)
            pos += len(step) + len(tag)
        return text, marks

    def encode(self, question: str, steps: list[str]) -> tuple[list[int], list[int]]:
        """Token ids of the rendered input and, per step, the index of the token its score is
        read at."""
        text, marks = self.render(question, steps)
        templated = self.settings.chat_template and getattr(self.tokenizer, "chat_template", None)
        enc = self.tokenizer(text, return_offsets_mapping=True, add_special_tokens=not templated)
        offsets = enc["offset_mapping"]
        positions = []
        for mark in marks:
            hits = [i for i, (a, b) in enumerate(offsets) if a <= mark < b]
            if not hits:
                raise ValueError(
                    f"step tag {self.settings.step_tag!r}: no token covers character {mark} of "
                    "the PRM's input; check reward.prm.step_tag"
                )
            positions.append(hits[-1])
        return enc["input_ids"], positions

    @torch.inference_mode()
    def score_batch(self, items: list[tuple[str, list[str]]]) -> list[list[float]]:
        """Step scores of (question, steps) pairs in one right-padded forward pass."""
        encoded = [self.encode(q, steps) for q, steps in items]
        device = next(self.model.parameters()).device
        width = max(len(ids) for ids, _ in encoded)
        ids = torch.full((len(encoded), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, (row, _) in enumerate(encoded):
            ids[i, : len(row)] = torch.tensor(row)
            mask[i, : len(row)] = 1
        logits = self.model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
        out = []
        for i, (_, positions) in enumerate(encoded):
            out.append(self.step_probs(logits[i, positions]).tolist())
        return out

    def step_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """(K, V) logits at K step tags -> (K,) probabilities that each step is good."""
        if self.candidates is not None:
            return logits[:, self.candidates].float().softmax(-1)[:, 0]
        return logits.float().softmax(-1)[:, self.settings.good_label]

    def steps(self, response: str) -> list[str]:
        """The response's steps (`omgrpo.core.process.split_steps` with the PRM's separator)."""
        return [response[a:b] for a, b in split_steps(response, self.settings.separator)]

    def __call__(self, questions: list[str], responses: list[str]) -> list[StepScores]:
        items = [(q, self.steps(r)) for q, r in zip(questions, responses)]
        return score_within_budget(items, self.score_batch, self.batch_size, self.budget_s)


def check_prm_weights(
    path: str | Path, settings: PrmSettings, model: torch.nn.Module, info: dict[str, Any]
) -> None:
    """Refuse (InputError naming the checkpoint and the weights) a PRM whose checkpoint lacks
    weights of the model `reward.prm.format` loads, which transformers would initialise at
    random: a base language model given as a token_classification PRM has no classification
    head, so every step would be scored by a random head (before: it trained to "run
    finished" on a random reward). Also a good_label past the head's labels."""
    from omgrpo.errors import InputError

    missing = sorted(info.get("missing_keys") or [])
    mismatched = sorted(
        str(k[0] if isinstance(k, tuple) else k) for k in info.get("mismatched_keys") or []
    )
    if missing or mismatched:
        shown = ", ".join((missing + mismatched)[:6]) + (
            " ..." if len(missing) + len(mismatched) > 6 else ""
        )
        raise InputError(
            f"not a {settings.format} PRM: the checkpoint has no {shown} (transformers would "
            "initialise them at random, so every step's score would be noise)",
            file=path,
            key="reward.prm.path",
            expected=f"a PRM checkpoint whose weights include the {settings.format} head "
            "(or set reward.prm.format to the checkpoint's kind)",
        )
    labels = getattr(model.config, "num_labels", None)
    classifies = settings.format == "token_classification" and labels is not None
    if classifies and not 0 <= settings.good_label < labels:
        raise InputError(
            f"the PRM's head has {labels} labels",
            file=path,
            key="reward.prm.good_label",
            found=settings.good_label,
            expected=f"a label index from 0 to {labels - 1}",
        )


def check_prm_checkpoint(prm_cfg: Any) -> None:
    """`reward.prm.path`, when it is a local directory, checked without reading a weight
    (transformers builds the model on the meta device and compares the checkpoint's keys):
    `check_prm_weights` before a run starts, so a PRM that is not one is refused before
    anything is written. A hub id and the toy PRM (null path) are checked when they load."""
    import contextlib
    import io

    from transformers.utils import logging as hf_logging

    path = prm_cfg.path
    if not path or not Path(str(path)).expanduser().is_dir():
        return
    path = Path(str(path)).expanduser()
    settings = PrmSettings.resolve(prm_cfg, path)
    auto = (
        AutoModelForCausalLM if settings.format == "causal_lm" else AutoModelForTokenClassification
    )
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its load report would say the same, as a warning
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            model, info = auto.from_pretrained(
                str(path), device_map="meta", output_loading_info=True
            )
    finally:
        hf_logging.set_verbosity(verbosity)
    check_prm_weights(path, settings, model, info)


def load_prm(
    path: str | Path, prm_cfg: Any, device: torch.device, dtype: torch.dtype
) -> ProcessRewardModel:
    """The PRM at `path` (a local directory or hub id) as `reward.prm` describes it, frozen on
    `device`."""
    settings = PrmSettings.resolve(prm_cfg, path)
    quiet_library_bars()
    auto = (
        AutoModelForCausalLM if settings.format == "causal_lm" else AutoModelForTokenClassification
    )
    model, info = auto.from_pretrained(str(path), dtype=dtype, output_loading_info=True)
    check_prm_weights(path, settings, model, info)
    model = model.to(device)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    return ProcessRewardModel(
        model, tokenizer, settings, batch_size=prm_cfg.batch_size, budget_s=prm_cfg.budget_s
    )

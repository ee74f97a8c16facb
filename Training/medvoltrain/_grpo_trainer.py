"""The GRPO trainer: TRL's ``GRPOTrainer`` with the grounder's own multimodal prompts.

Imports torch and trl when imported, so :func:`medvoltrain.grpo.train_grpo` imports this module
only when it builds the trainer, and importing :mod:`medvoltrain.grpo` stays cheap. What the
trainer overrides and why: :mod:`medvoltrain.grpo`.
"""

from __future__ import annotations

import logging

import torch
from transformers import TrainerCallback
from trl import GRPOTrainer

from .prepare import load_slices

log = logging.getLogger("medvoltrain.grpo")


class GrounderGRPOTrainer(GRPOTrainer):
    """TRL's GRPOTrainer with the grounder's own multimodal prompts (see :mod:`medvoltrain.grpo`).

    Images are tied to **samples**, never to prompt text: two volumes asked the same question
    have the same prompt token ids (the image slots are identical placeholders), so a row's
    images can only be found from the sample it was generated for. While TRL generates and
    scores a batch, ``_batch_rows`` holds each row's sample id; the batch TRL returns carries
    every row's own images (``pixel_values``, ``image_grid_thw``, ``num_images``,
    ``mm_token_type_ids``, as TRL's processor-based VLM path does), so its shuffling, splitting
    into accumulation steps and loss pass keep each row with its pixels."""

    def __init__(self, *args, grounder=None, samples=None, **kwargs):
        self.grounder = grounder
        self.samples_by_id = {s["id"]: s for s in samples}
        # sample id → (prompt ids, pixel_values, image_grid_thw, mm_token_type_ids); one generation batch only
        self._batch_inputs = {}
        self._batch_rows = None  # the sample id of each row while TRL generates and scores a batch
        super().__init__(*args, **kwargs)

    def _sample_inputs(self, sample_id: str):
        if sample_id not in self._batch_inputs:
            sample = self.samples_by_id[sample_id]
            inputs = self.grounder.inputs_from_images(load_slices(sample), sample["shown"], int(sample["depth"]),
                                                      sample["query"], sample.get("prompt_window"))
            self._batch_inputs[sample_id] = (inputs["input_ids"][0].tolist(), inputs["pixel_values"],
                                             inputs["image_grid_thw"], inputs["mm_token_type_ids"][0])
        return self._batch_inputs[sample_id]

    def _tokenize_prompts(self, prompts):
        # TRL's prompt column holds the sample id (grpo_dataset); one entry per row
        entries = [self._sample_inputs(p) for p in prompts]
        ids, pv, grid, mm = zip(*entries)
        fields = {"pixel_values": torch.cat(pv), "image_grid_thw": torch.cat(grid),
                  "mm_token_type_ids": [m.tolist() for m in mm]}
        return list(ids), None, fields

    def _generate_and_score_completions(self, inputs):
        self._batch_inputs = {}
        self._batch_rows = [x["prompt"] for x in inputs]
        try:
            output = super()._generate_and_score_completions(inputs)
            ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
            mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
            pv, grid, counts, mm = self._row_images(ids, mask, output["completion_ids"].size(1))
            output.update(pixel_values=pv, image_grid_thw=grid, num_images=counts, mm_token_type_ids=mm)
        finally:
            self._batch_rows = None
            self._batch_inputs = {}  # the returned batch carries the pixels from here on
        return output

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                           batch_size=None, compute_entropy=False, compute_aux_loss=False,
                                           pixel_values=None, image_grid_thw=None, num_images=None,
                                           mm_token_type_ids=None, **kwargs):
        if pixel_values is None:  # TRL's passes inside generation: the batch does not carry images yet
            pixel_values, image_grid_thw, num_images, mm_token_type_ids = self._row_images(
                input_ids, attention_mask, logits_to_keep)
        return super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
            compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, pixel_values=pixel_values,
            image_grid_thw=image_grid_thw, num_images=num_images, mm_token_type_ids=mm_token_type_ids, **kwargs)

    def _row_images(self, input_ids, attention_mask, logits_to_keep):
        """Image inputs of rows ``[left-padded prompt | completion]`` of the batch being generated, row r
        from sample ``_batch_rows[r]``; refuses rows whose prompt is not that sample's."""
        rows = self._batch_rows
        if rows is None or len(rows) != input_ids.size(0):
            raise RuntimeError("GRPO: a scoring pass without its images (rows do not match the generation batch)")
        width = input_ids.size(1) - logits_to_keep
        pv, grids, counts = [], [], []
        mm = torch.zeros_like(input_ids, dtype=torch.int32)
        for r, sample_id in enumerate(rows):
            ids, p, g, m = self._sample_inputs(sample_id)
            keep = attention_mask[r, :width].bool()
            if input_ids[r, :width][keep].tolist() != ids:
                raise RuntimeError(f"GRPO: row {r}'s prompt is not the one built for {sample_id}")
            pv.append(p)
            grids.append(g)
            counts.append(int(g.shape[0]))
            mm[r, width - m.shape[0]:width] = m.to(mm.device)
        device = input_ids.device
        return torch.cat(pv).to(device), torch.cat(grids).to(device), counts, mm


class ZeroRewardStdWarning(TrainerCallback):
    """Warns once per streak when every group's rewards have been equal for ``steps`` optimiser steps
    in a row (TRL logs ``frac_reward_zero_std``, the fraction of groups whose rewards have zero spread):
    the group-normalised advantages are then all zero and the policy gets no learning signal."""

    def __init__(self, steps: int):
        self.steps = int(steps)
        self.last_step = 0  # the step of the previous training log
        self.streak_from = None  # the last step before the current run of zero-spread logs
        self.warned = False

    def on_log(self, args, state, control, logs=None, **kwargs):
        frac = (logs or {}).get("frac_reward_zero_std")  # training logs only (evaluation's are eval_*)
        if frac is None:
            return
        step = int(state.global_step)
        if frac >= 1.0 - 1e-6:  # averaged over the steps since the last log: 1 only if every step had it
            if self.streak_from is None:
                self.streak_from = self.last_step
            if self.steps and not self.warned and step - self.streak_from >= self.steps:
                self.warned = True
                log.warning("GRPO has had no learning signal for %d step(s) (steps %d-%d): every group's %d "
                            "rollouts got the same reward (frac_reward_zero_std = 1), so every advantage is 0. "
                            "Check the rollouts (log_completions=true) and rewards/format/mean; more rollouts "
                            "(num_generations) or a better SFT adapter usually help", step - self.streak_from,
                            self.streak_from + 1, step, getattr(args, "num_generations", 0))
        else:
            self.streak_from, self.warned = None, False
        self.last_step = step


__all__ = ["GrounderGRPOTrainer", "ZeroRewardStdWarning"]

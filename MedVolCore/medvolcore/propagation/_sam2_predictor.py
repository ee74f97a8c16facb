"""MedVol's subclass of sam2's video predictor (this module imports torch and sam2).

Hydra builds it from sam2's packaged config with ``model._target_`` naming
``medvolcore.propagation._sam2_predictor.MedSAM2VideoPredictor`` (see
:mod:`medvolcore.propagation.build`), so only code that builds a predictor
imports this module: importing :mod:`medvolcore.propagation` loads neither torch nor sam2.

What it adds to ``SAM2VideoPredictor`` (sam2 1.1.0):

* :meth:`~MedSAM2VideoPredictor.init_state_from_frames`: an inference state over in-memory lazy
  frames (:class:`~medvolcore.propagation.frames.MedSAM2Frames`) instead of a JPEG folder;
* ``_get_image_feature``: the feature cache keeps the pinned frames (the key slice) and the most
  recent one, and, with shared features, reuses every slice already encoded for these frames;
* :meth:`~MedSAM2VideoPredictor.track_objects`: one direction of ``propagate_in_video`` with early
  stop per object and batched tracking of the objects still alive.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

import torch
from sam2.sam2_video_predictor import SAM2VideoPredictor

from .frames import MedSAM2Frames

__all__ = ["MedSAM2VideoPredictor"]


class MedSAM2VideoPredictor(SAM2VideoPredictor):
    """sam2's video predictor with in-memory lazy frames and a pinned feature cache."""

    @torch.inference_mode()
    def init_state_from_frames(self, frames, video_height: int, video_width: int, warm_up: bool = False) -> dict:
        """An inference state over ``frames`` (any sequence of (3, S, S) tensors).

        Same keys as sam2 1.1.0's ``init_state``, which only accepts a path. Unlike it,
        there is no warm-up encode of frame 0 unless ``warm_up`` is true.
        """
        device = self.device
        state = {}
        state["images"] = frames
        state["num_frames"] = len(frames)
        state["offload_video_to_cpu"] = False
        state["offload_state_to_cpu"] = False
        state["video_height"] = int(video_height)
        state["video_width"] = int(video_width)
        state["device"] = device
        state["storage_device"] = device
        state["point_inputs_per_obj"] = {}
        state["mask_inputs_per_obj"] = {}
        state["cached_features"] = {}
        state["constants"] = {}
        state["obj_id_to_idx"] = OrderedDict()
        state["obj_idx_to_id"] = OrderedDict()
        state["obj_ids"] = []
        state["output_dict_per_obj"] = {}
        state["temp_output_dict_per_obj"] = {}
        state["frames_tracked_per_obj"] = {}
        if warm_up:
            self._get_image_feature(state, frame_idx=0, batch_size=1)
        return state

    def _get_image_feature(self, inference_state, frame_idx, batch_size):
        frames = inference_state["images"]
        if isinstance(frames, MedSAM2Frames):
            cache = inference_state["cached_features"]
            store = frames.feature_store
            if frame_idx not in cache:
                if store is not None and frame_idx in store:
                    entry = store[frame_idx]
                else:
                    image = frames[frame_idx].to(inference_state["device"]).float().unsqueeze(0)
                    entry = (image, self.forward_image(image))
                    frames.encoded.append(int(frame_idx))
                    if store is not None:
                        store[frame_idx] = entry
                # keep the pinned frames (the key slice) and the most recent one
                kept = {k: v for k, v in cache.items() if k in frames.pinned}
                kept[frame_idx] = entry
                inference_state["cached_features"] = kept
        # a cache hit now for our frames; sam2's stock behaviour for any other "images"
        return super()._get_image_feature(inference_state, frame_idx, batch_size)

    @torch.inference_mode()
    def track_objects(self, inference_state, start_frame_idx: int, max_frame_num_to_track: int,
                      reverse: bool = False, stop_after_empty: int = 0, batch_objects: bool = True):
        """sam2's ``propagate_in_video`` for one direction, with early stop and batched tracking.

        Yields ``(frame_idx, obj_indices, video_res_logits)`` per frame, in sam2's processing
        order (the same frames ``propagate_in_video`` visits for these arguments), where
        ``obj_indices`` are the 0-based indices of the objects still tracked on that frame and
        ``video_res_logits`` is ``(len(obj_indices), 1, H, W)`` at the video's resolution.

        ``stop_after_empty = K > 0``: an object whose mask (logit > 0) has been empty on ``K``
        consecutive frames after the start frame stops being tracked; the generator ends when
        no object is left. A frame prompted for an object (one of its conditioning frames)
        never counts as empty for it, and an object is not stopped while it has prompted
        frames ahead in this direction. ``K = 0`` tracks every object to the end (sam2's behaviour).
        sam2 1.1 tracks objects one by one, each with its own memory; ``batch_objects`` runs
        the still-tracked objects of a frame as one batch instead (the way sam2 1.0 tracked
        them), on a batched view of their memories. Objects never interact either way (no
        non-overlap constraint is applied: ``non_overlap_masks*`` are False in MedSAM2's
        config, and batching is refused otherwise), so dropping one object leaves the
        others' masks unchanged.

        During each tracking step ``inference_state["tracking_obj_indices"]`` holds the
        objects of that step (a list of indices, in batch order), for instrumentation.
        """
        self.propagate_in_video_preflight(inference_state)
        per_obj = inference_state["output_dict_per_obj"]
        n_obj = self._get_obj_num(inference_state)
        num_frames = inference_state["num_frames"]
        if reverse:
            end = max(start_frame_idx - max_frame_num_to_track, 0)
            # sam2 skips reverse tracking that starts at frame 0
            order = range(start_frame_idx, end - 1, -1) if start_frame_idx > 0 else range(0)
        else:
            end = min(start_frame_idx + max_frame_num_to_track, num_frames - 1)
            order = range(start_frame_idx, end + 1)
        if batch_objects and (self.non_overlap_masks or self.non_overlap_masks_for_mem_enc):
            batch_objects = False  # objects interact there: keep sam2's one-by-one tracking
        active = list(range(n_obj))
        empty_run = [0] * n_obj
        batched = None  # output dict of the active objects, batched along dim 0
        for frame_idx in order:
            preds = {}
            todo = []
            for i in active:
                cond = per_obj[i]["cond_frame_outputs"]
                if frame_idx in cond:  # the prompted frame: its output is already there
                    preds[i] = cond[frame_idx]["pred_masks"].to(inference_state["device"], non_blocking=True)
                    if self.clear_non_cond_mem_around_input:
                        self._clear_obj_non_cond_mem_around_input(inference_state, frame_idx, i)
                else:
                    todo.append(i)
            if todo and batch_objects and len(todo) > 1:
                if batched is None or batched["objects"] != todo:
                    batched = _batched_outputs(per_obj, todo, batched)
                inference_state["tracking_obj_indices"] = list(todo)
                out, masks = self._run_single_frame_inference(
                    inference_state=inference_state, output_dict=batched, frame_idx=frame_idx,
                    batch_size=len(todo), is_init_cond_frame=False, point_inputs=None, mask_inputs=None,
                    reverse=reverse, run_mem_encoder=True)
                batched["non_cond_frame_outputs"][frame_idx] = out
                for row, i in enumerate(todo):
                    preds[i] = masks[row:row + 1]
            else:
                for i in todo:
                    if batched is not None:  # back to one by one: hand the batched memory back
                        _unbatch_outputs(per_obj, batched)
                        batched = None
                    inference_state["tracking_obj_indices"] = [i]
                    out, masks = self._run_single_frame_inference(
                        inference_state=inference_state, output_dict=per_obj[i], frame_idx=frame_idx,
                        batch_size=1, is_init_cond_frame=False, point_inputs=None, mask_inputs=None,
                        reverse=reverse, run_mem_encoder=True)
                    per_obj[i]["non_cond_frame_outputs"][frame_idx] = out
                    preds[i] = masks
            inference_state.pop("tracking_obj_indices", None)
            for i in active:
                inference_state["frames_tracked_per_obj"][i][frame_idx] = {"reverse": reverse}
            objs = list(active)
            all_masks = torch.cat([preds[i] for i in objs], dim=0) if len(objs) > 1 else preds[objs[0]]
            _, video_res = self._get_orig_video_res_output(inference_state, all_masks)
            yield frame_idx, objs, video_res
            if stop_after_empty > 0 and frame_idx != start_frame_idx:
                nonempty = (video_res[:, 0] > 0).flatten(1).any(dim=1).tolist()
                for i, ne in zip(objs, nonempty):
                    # a prompted frame never counts as empty
                    empty_run[i] = 0 if ne or frame_idx in per_obj[i]["cond_frame_outputs"] else empty_run[i] + 1
                # an object is not stopped before it has passed its last prompted frame
                active = [i for i in objs if empty_run[i] < stop_after_empty or _prompted_ahead(per_obj[i], frame_idx, reverse)]
                if not active:
                    return
        if batched is not None:
            _unbatch_outputs(per_obj, batched)


def _prompted_ahead(obj_out: dict, frame_idx: int, reverse: bool) -> bool:
    cond = obj_out["cond_frame_outputs"]
    return any(t < frame_idx for t in cond) if reverse else any(t > frame_idx for t in cond)


def _stack_outputs(outs: list) -> dict:
    """sam2 per-frame outputs of single objects → one output with the objects along dim 0."""
    import torch

    first = outs[0]
    merged = {}
    for key, value in first.items():
        if value is None:
            merged[key] = None
        elif key == "maskmem_pos_enc":  # the same for every object (sam2 stores one expanded copy)
            merged[key] = [x[:1].expand(len(outs), *x.shape[1:]) for x in value]
        else:
            merged[key] = torch.cat([o[key] for o in outs], dim=0)
    return merged


def _row_output(out: dict, row: int) -> dict:
    return {key: (None if v is None else [x[row:row + 1] for x in v] if isinstance(v, list) else v[row:row + 1])
            for key, v in out.items()}


def _batched_outputs(per_obj: dict, objects: list, previous: Optional[dict]) -> dict:
    """A sam2 output dict for ``objects`` tracked as one batch (rows in the order of ``objects``).

    ``previous`` (a batched dict of an earlier object set) is handed back to the per-object dicts
    first, so every object's memory is complete before the new batch is built.
    """
    if previous is not None:
        _unbatch_outputs(per_obj, previous)
    batched = {"objects": list(objects), "cond_frame_outputs": {}, "non_cond_frame_outputs": {}}
    for key in ("cond_frame_outputs", "non_cond_frame_outputs"):
        frames = per_obj[objects[0]][key].keys()
        for t in frames:
            batched[key][t] = _stack_outputs([per_obj[i][key][t] for i in objects])
    return batched


def _unbatch_outputs(per_obj: dict, batched: dict) -> None:
    """Write the frames tracked in a batch back to each object's own output dict (as row views)."""
    for t, out in batched["non_cond_frame_outputs"].items():
        for row, i in enumerate(batched["objects"]):
            per_obj[i]["non_cond_frame_outputs"][t] = _row_output(out, row)

"""``from smpart.integrations.transformers import Trainer``: Hugging Face's ``Trainer``, split by smpart.

A script such as Hugging Face's ``run_clm.py`` trains split with two lines changed: this import in
place of ``from transformers import Trainer``, and ``smpart.init(...)`` before the ``Trainer`` is
made (on threads, or on every rank under ``torchrun``). The subclass takes the same arguments and
covers what the ``Trainer``'s own SageMaker model-parallel path covered:

- **the model** is wrapped in an `DistributedModel` (`_wrap_model`), split at its first step;
- **training** runs each batch through an ``@smpart.step`` over micro-batches: the ``Trainer``'s own
  ``compute_loss`` (a subclass's too) under its autocast, then ``model.backward``. A loss normalised
  by the number of label tokens (``num_items_in_batch``) is a sum over tokens, so its micro-batch
  gradients are summed, not averaged; a per-batch mean is divided by the accumulation steps, as the
  ``Trainer`` does. Gradient accumulation is the ``Trainer``'s, over steps;
- **evaluation and prediction** are forward-only steps, their logits concatenated over micro-batches
  and gathered over the data-parallel replicas only;
- **batches** are sharded by data-parallel rank (every stage and tensor-parallel rank of a replica
  reads the same batch): each replica takes its slice of a global batch of ``per_device_batch x dp``
  drawn as a one-process ``Trainer`` draws it, so the same global batch trains the same model;
- **the optimizer** is an `DistributedOptimizer` (it steps the parameters placement put in
  place, tensor-parallel shards included), the scheduler steps it; **clipping** is over the whole
  model (`DistributedOptimizer.clip_grad_norm_`);
- **checkpoints** (``save_steps``, ``resume_from_checkpoint``) hold the model and the optimizer as an
  smpart checkpoint (``checkpoint-N/smpart``, loadable under any layout), the full model as
  ``save_pretrained`` writes it (first rank), the scheduler, the trainer state and each rank's RNG
  states; **logging and saving** happen once (the first rank); **bf16** is the ``Trainer``'s autocast
  inside the step, carried to every stage.

Every batch splits into ``microbatches`` equal pieces: choose batch sizes they divide, and a last
uneven training batch is best dropped (``dataloader_drop_last=True``); an uneven one fails with an
`SmpartError` naming the sizes.

``transformers`` (and ``accelerate``, which its ``Trainer`` needs) stay optional: importing this
module without them raises an `SmpartError` saying what to install.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from smpart.errors import SmpartError
from smpart.runtime import DistributedModel, DistributedOptimizer, dp_rank, dp_size, get_dp_group, step
from smpart.runtime.grad_scaler import GradScaler
from smpart.runtime.runtime import current_runtime, running_runtime

try:
    import transformers
    from transformers.trainer import SCHEDULER_NAME
    from transformers.trainer_pt_utils import nested_detach
except ImportError as err:  # pragma: no cover - the dev extra installs it
    raise SmpartError("smpart.integrations.transformers needs Hugging Face transformers and accelerate: "
                      "pip install transformers accelerate") from err

#: Where in a ``checkpoint-N`` directory the smpart checkpoint of the model and optimizer lives.
CHECKPOINT_DIR = "smpart"


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` with the model split by smpart; call ``smpart.init(...)`` first."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if running_runtime() is None:
            raise SmpartError("smpart.integrations.transformers.Trainer splits the model as "
                              "smpart.init(...) configured it: call "
                              "smpart.init(pipeline_parallel_degree=..., microbatches=...) before making the "
                              "Trainer")
        self._split_model: DistributedModel | None = None
        super().__init__(*args, **kwargs)
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None:  # fp16: every rank must agree on the scale and on skipping a step
            self.accelerator.scaler = GradScaler(
                scaler._device, init_scale=scaler._init_scale, growth_factor=scaler.get_growth_factor(),
                backoff_factor=scaler.get_backoff_factor(), growth_interval=scaler.get_growth_interval())
        self._train_step = step(self._train_body, non_split_inputs=["num_items_in_batch"])
        self._predict_step = step(self._predict_body, non_split_inputs=["num_items_in_batch"])

    # ================================================================== the model and optimizer
    def _wrap_model(self, model: Any, training: bool = True, dataloader: Any = None) -> Any:
        if isinstance(model, DistributedModel):
            return model
        if self._split_model is None or self._split_model.module is not self.model:
            self._split_model = DistributedModel(self.model)
        return self._split_model

    def create_optimizer(self, model: Any = None) -> torch.optim.Optimizer:
        super().create_optimizer(model)
        if not isinstance(self.optimizer, DistributedOptimizer):
            self.optimizer = DistributedOptimizer(self.optimizer)
        return self.optimizer

    def _distributed_optimizer(self) -> DistributedOptimizer:
        optimizer = self.optimizer
        while not isinstance(optimizer, DistributedOptimizer):  # accelerate wraps it
            optimizer = optimizer.optimizer
        return optimizer

    def get_tp_size(self) -> int:
        """Processes that read one batch: a replica's stages and tensor-parallel ranks. The
        ``Trainer`` divides its token counts and scales its losses by it, as for its own TP."""
        return max(self.args.world_size // dp_size(), 1)

    # ================================================================== training
    def training_step(self, model: Any, inputs: dict[str, Any],
                      num_items_in_batch: Any = None) -> torch.Tensor:
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        inputs = self._prepare_inputs(inputs)
        losses = self._train_step(model, inputs, num_items_in_batch)
        loss = losses.reduce_sum() if self._loss_is_a_sum(num_items_in_batch) else losses.reduce_mean()
        return loss.detach().to(self.args.device)

    def _train_body(self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any) -> torch.Tensor:
        with self.compute_loss_context_manager(), self.accelerator.autocast():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        if self.args.n_gpu > 1:
            loss = loss.mean()
        if self._loss_is_a_sum(num_items_in_batch):
            # A sum over tokens: the micro-batches' gradients add up (smpart averages them).
            backward = loss * current_runtime().config.microbatches
        else:
            loss = loss / self.current_gradient_accumulation_steps
            backward = loss
        scaler = getattr(self.accelerator, "scaler", None)
        model.backward(scaler.scale(backward) if scaler is not None else backward)
        return loss.detach()

    def _loss_is_a_sum(self, num_items_in_batch: Any) -> bool:
        """Whether the loss was normalised over the whole accumulated batch (as the ``Trainer`` decides)."""
        if self.loss_is_scaled_for_ga is not None:
            return bool(self.loss_is_scaled_for_ga)
        return (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or \
            self.compute_loss_func is not None

    def _clip_grad_norm(self, model: Any) -> torch.Tensor:
        self._unscale_gradients()
        return self._distributed_optimizer().clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        if grad_norm is None:
            self._unscale_gradients()
            grad_norm = self._distributed_optimizer().clip_grad_norm_(float("inf"))
        return grad_norm

    def _unscale_gradients(self) -> None:
        if getattr(self.accelerator, "scaler", None) is not None:
            self.accelerator.unscale_gradients()

    # ================================================================== evaluation and prediction
    def prediction_step(self, model: Any, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None) -> tuple[Any, Any, Any]:
        has_labels = bool(self.label_names) and all(inputs.get(k) is not None for k in self.label_names)
        return_loss = inputs.get("return_loss")
        if return_loss is None:
            return_loss = self.can_return_loss
        with_loss = has_labels or (not self.label_names and return_loss)
        inputs = self._prepare_inputs(inputs)
        if ignore_keys is None:
            config = getattr(self.model, "config", None)
            ignore_keys = getattr(config, "keys_to_ignore_at_inference", ["cache"])
        labels = None
        if with_loss:
            labels = nested_detach(tuple(inputs.get(name) for name in self.label_names))
            labels = labels[0] if len(labels) == 1 else labels
        num_items = self._get_num_items_in_batch([inputs], self.args.device) if with_loss else None
        with torch.no_grad():
            losses, logits = self._predict_step(model, inputs, num_items, with_loss, list(ignore_keys))
        loss = None
        if with_loss:
            loss = losses.reduce_sum() if self._loss_is_a_sum(num_items) else losses.reduce_mean()
            loss = loss.detach()
        if prediction_loss_only:
            return loss, None, None
        logits = _concat_microbatches(logits.outputs)
        return loss, logits[0] if len(logits) == 1 else logits, labels

    def _predict_body(self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any, with_loss: bool,
                      ignore_keys: list[str]) -> tuple[Any, tuple]:
        loss = None
        with self.compute_loss_context_manager(), self.accelerator.autocast():
            if with_loss:
                loss, outputs = self.compute_loss(model, inputs, return_outputs=True,
                                                  num_items_in_batch=num_items_in_batch)
                loss = loss.detach().mean()
                ignore_keys = [*ignore_keys, "loss"]
            else:
                outputs = model(**inputs)
        if isinstance(outputs, dict):
            logits = tuple(v for k, v in outputs.items() if k not in ignore_keys)
        else:
            logits = tuple(outputs[1:] if with_loss else outputs)
        return loss, logits

    @property
    def gather_function(self) -> Any:
        """Gathers evaluation tensors over the data-parallel replicas only (each replica's stages and
        tensor-parallel ranks hold the same ones); the ``Trainer`` assigns it, in vain."""
        return self._gather_replicas

    @gather_function.setter
    def gather_function(self, value: Any) -> None:
        pass

    def _gather_replicas(self, tensors: Any, **_: Any) -> Any:
        group = get_dp_group()
        if group is not None:
            every: list[Any] = [None] * dist.get_world_size(group)
            dist.all_gather_object(every, _to_cpu(tensors), group=group)
            tensors = _concat_leaves(every)
        state = self.accelerator.gradient_state
        if state.end_of_dataloader and state.remainder > 0:  # the padding of an uneven last batch
            tensors = _map_tensors(tensors, lambda t: t[:state.remainder])
        return tensors

    # ================================================================== batches
    def _get_dataloader(self, dataset: Any, description: str, batch_size: int, sampler_fn: Any = None,
                        is_training: bool = False, dataloader_key: str | None = None) -> Any:
        """The ``Trainer``'s loader of the global batch (``batch_size`` x replicas), each replica
        taking its slice of every batch."""
        with self._loaders_split_by_replica():
            return super()._get_dataloader(dataset, description, batch_size * dp_size(), sampler_fn,
                                           is_training, dataloader_key)

    @contextlib.contextmanager
    def _loaders_split_by_replica(self) -> Iterator[None]:
        from accelerate.data_loader import prepare_data_loader

        accelerator = self.accelerator

        def prepare(data_loader: Any, device_placement: Any = None, slice_fn_for_dispatch: Any = None) -> Any:
            placed = accelerator.device_placement if device_placement is None else device_placement
            prepared = prepare_data_loader(
                data_loader, accelerator.device, num_processes=dp_size(),
                process_index=dp_rank(), split_batches=True, put_on_device=placed,
                rng_types=accelerator.rng_types.copy(), dispatch_batches=False,
                even_batches=accelerator.even_batches, use_seedable_sampler=accelerator.use_seedable_sampler,
                data_seed=accelerator.dataloader_config.data_seed, non_blocking=accelerator.non_blocking,
                use_stateful_dataloader=accelerator.use_stateful_dataloader)
            accelerator._dataloaders.append(prepared)
            return prepared

        accelerator.prepare_data_loader = prepare
        try:
            yield
        finally:
            del accelerator.prepare_data_loader

    # ================================================================== saving and resuming
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The full model, as ``save_pretrained`` writes it, by the first rank; every rank calls it
        (the state dict is gathered from every stage and shard)."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        model = self._split_model
        state_dict = model.state_dict() if model is not None and model.partition is not None else None
        if self.args.should_save:
            self._save(output_dir, state_dict=state_dict)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        from smpart.checkpoint import save_checkpoint

        save_checkpoint(os.path.join(output_dir, CHECKPOINT_DIR), self._split_model,
                               self._distributed_optimizer())
        if self.args.should_save:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if os.path.isdir(os.path.join(resume_from_checkpoint, CHECKPOINT_DIR)):
            return  # the model's tensors are read with the optimizer's (`_load_optimizer_and_scheduler`)
        super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not os.path.isdir(os.path.join(checkpoint, CHECKPOINT_DIR)):
            return super()._load_optimizer_and_scheduler(checkpoint)
        from smpart.checkpoint import load_checkpoint

        load_checkpoint(os.path.join(checkpoint, CHECKPOINT_DIR), self._wrap_model(self.model),
                               self._distributed_optimizer(), restore_rng=False)  # the Trainer restores RNG
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME),
                                                         weights_only=True))


def _to_cpu(tensors: Any) -> Any:
    return _map_tensors(tensors, lambda t: t.detach().cpu())


def _map_tensors(value: Any, fn: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, list | tuple):
        return type(value)(_map_tensors(v, fn) for v in value)
    if isinstance(value, dict):
        return type(value)({k: _map_tensors(v, fn) for k, v in value.items()})
    return value


def _concat_leaves(parts: list[Any]) -> Any:
    """``parts`` (one per replica, the same structure) with each tensor concatenated along axis 0."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat([p if p.dim() else p.unsqueeze(0) for p in parts])
    if isinstance(first, list | tuple):
        return type(first)(_concat_leaves([p[i] for p in parts]) for i in range(len(first)))
    if isinstance(first, dict):
        return type(first)({k: _concat_leaves([p[k] for p in parts]) for k in first})
    return first


def _concat_microbatches(per_microbatch: list[tuple]) -> tuple:
    """Each output's micro-batch pieces concatenated along the batch axis (what is not a tensor: dropped)."""
    return tuple(torch.cat([mb[i] for mb in per_microbatch]) if isinstance(per_microbatch[0][i], torch.Tensor)
                 else None for i in range(len(per_microbatch[0])))

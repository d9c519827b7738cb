"""`LLM`: the offline API, with vLLM's names (`vllm.LLM.generate` / `chat`)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping, Sequence

import torch
from tqdm.auto import tqdm

from batchgen.config import EngineConfig, ParallelConfig
from batchgen.config_fields import close_name
from batchgen.entrypoints.vllm_flags import take_vllm_kwargs
from batchgen.engine.llm_engine import LLMEngine
from batchgen.engine.weight_update import WeightsLike, update_weights
from batchgen.entrypoints.openai_protocol import parse_messages
from batchgen.outputs import RequestOutput
from batchgen.parallel_config import check_tensor_parallel_size
from batchgen.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict


class LLM:
    """Load a model and generate for many prompts at once.

    Args:
        model: local HF checkpoint directory or hub id; None uses the embedded default model
            (or the cluster file's model).
        config: a cluster file (``batchgen_cluster:``, docs/cluster-config.md); ``model`` and
            ``kwargs`` override its settings key by key, in their own (flag) meaning:
            ``data_parallel_size`` here counts ranks, in the file replicas.
        **kwargs: any `EngineConfig` field (``dtype``, ``device``, ``max_model_len``,
            ``max_num_seqs``, ``max_num_batched_tokens``, ``kv_cache_memory_gb``, ...) or
            `ParallelConfig` field (``data_parallel_size``, ``enable_expert_parallel``,
            ``prefill_strategy``, ...). With more than one rank the engine is a
            `DPEngineClient` driving rank processes; call `shutdown` (or let the object go) to
            stop them. vLLM's ``tensor_parallel_size`` is accepted at 1 (a no-op).

    Raises:
        ValueError: invalid settings (the message names the field), unsupported architecture,
            unresolvable model, more local ranks than CUDA devices.
        batchgen.cluster_config.ClusterConfigError: (a `ValueError`) an invalid cluster file,
            before any weights load.
    """

    def __init__(
        self, model: str | None = None, config: str | os.PathLike | None = None, **kwargs
    ) -> None:
        engine, parallel, overrides = _resolve_configs(model, config, kwargs, this_machine=True)
        for note in overrides:  # flags / arguments that replace keys of the cluster file
            logger.info("%s", note)
        for warning in parallel.ineffective_settings():
            logger.warning("%s", warning)
        if parallel.snapshot_storage_uri is not None:
            logger.warning(
                "snapshot_storage_uri=%r has no effect here: only `batchgen run` stores a "
                "snapshot (of a batch file's results)",
                parallel.snapshot_storage_uri,
            )
        if parallel.is_distributed:
            from batchgen.distributed.frontend import DPEngineClient

            self.llm_engine = DPEngineClient(engine, parallel)
        else:
            self.llm_engine = LLMEngine(engine)
        self._counter = 0

    def shutdown(self) -> None:
        """Stop the rank processes of a data-parallel engine (a no-op for one process)."""
        shutdown = getattr(self.llm_engine, "shutdown", None)
        if shutdown is not None:
            shutdown()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def update_weights(self, weights: WeightsLike) -> int:
        """Replace some or all of the model's weights in place, between `generate` calls,
        without reloading the engine (RL rollouts: load each new policy step).

        Args:
            weights: Hugging Face checkpoint names -> tensors (a state dict such as
                ``hf_model.state_dict()``, possibly partial: only the named tensors change;
                or an iterable of ``(name, tensor)`` pairs), or the path of a safetensors
                checkpoint directory of the same model. Names map to the engine's parameters
                as at load time (``q_proj``/``k_proj``/``v_proj`` into one projection, per-expert
                ``w1/w2/w3`` or ``gate_proj/up_proj/down_proj`` and fused
                ``experts.gate_up_proj [E, 2I, H]`` / ``experts.down_proj [E, H, I]`` into the
                stacked expert weights). Any floating dtype and device: tensors are converted
                to the engine's dtype and device.
        Returns:
            The number of checkpoint tensors copied (also logged). Afterwards the prefix cache
            is reset and the CPU MoE kernel's packed weights are rebuilt on the next forward.
        Raises:
            ValueError: an unknown name, a wrong shape (the message names the tensor and the
                expected shape), a non-floating tensor, or a directory of another model; every
                tensor is checked before any is copied, so nothing has changed then.
            TypeError: a value that is not a tensor.
            RuntimeError: requests are in flight (only possible through ``llm_engine``).
            NotImplementedError: a data-parallel engine with
                ``prefill_strategy='data_parallel_offload'``.

        On a data-parallel engine every rank is updated (an expert-parallel rank copies only
        its experts) and the count is of distinct tensors copied; a rank restarted after a
        failure applies the updates made since the start before it serves
        (`batchgen.distributed.frontend_weights`).
        """
        if isinstance(self.llm_engine, LLMEngine):
            return update_weights(self.llm_engine, weights)
        return self.llm_engine.update_weights(weights)

    def update_weights_from_tensor(
        self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
    ) -> int:
        """SGLang's name for `update_weights` with tensors (``[(name, tensor), ...]`` or a
        state dict). Errors raise, as in `update_weights`, instead of SGLang's
        ``(success, message)`` pair; the prefix cache is always flushed."""
        return self.update_weights(named_tensors)

    def update_weights_from_disk(self, model_path: str | os.PathLike) -> int:
        """SGLang's name for `update_weights` with a checkpoint directory."""
        return self.update_weights(model_path)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix so that no K/V computed before is reused (vLLM's name);
        False while requests are in flight. `update_weights` does this itself. On a
        data-parallel engine, every rank's cache."""
        if isinstance(self.llm_engine, LLMEngine):
            return self.llm_engine.kv_cache.reset_prefix_cache()
        return self.llm_engine.reset_prefix_cache()

    def get_metrics(self) -> dict:
        """Engine metrics since start: prefill/decode/total tokens/s, expert GEMM count, mean
        rows per expert GEMM, tile density, time share per stage, peak memory."""
        return self.llm_engine.get_metrics()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order.

        Args:
            prompts: a string, a list of token ids, a ``{"prompt_token_ids": [...]}`` dict, or a
                list of these.
            sampling_params: one for all prompts, or one per prompt; default `SamplingParams()`.
        Returns:
            One `RequestOutput` per prompt. A prompt that cannot run on its own (empty, longer
            than ``max_model_len``...) gets ``error`` set and no outputs, and a warning naming
            its index in ``prompts`` is logged; the others still run.
        Raises:
            ValueError: a list of sampling params whose length differs from the prompts'.
        """
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        return self._run(prompts, _params_per_prompt(sampling_params, len(prompts)), use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of conversations, applying the
        tokenizer's chat template with the generation prompt.

        Each `RequestOutput.prompt` is the rendered conversation (the template's text, as
        vLLM returns it). A conversation that cannot run gets ``error`` set, as in `generate`;
        the warning names its index in the list of conversations.
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        engine = self.llm_engine
        prompts: list[PromptType] = []
        errors: dict[int, str] = {}
        for i, conv in enumerate(conversations):
            try:
                # Same normalisation as the batch/HTTP path: text content parts are joined,
                # role "developer" becomes "system".
                conv = parse_messages(conv)
                rendered = engine.input_processor.render_chat(conv)
                prompts.append(
                    {"prompt_token_ids": rendered.prompt_token_ids, "prompt": rendered.prompt}
                )
            except ValueError as exc:
                errors[i] = str(exc)
                prompts.append({"prompt_token_ids": []})
        params = _params_per_prompt(sampling_params, len(prompts))
        return self._run(prompts, params, use_tqdm, errors=errors, what="conversation")

    def _run(
        self,
        prompts: list[PromptType],
        params: list[SamplingParams],
        use_tqdm: bool,
        *,
        errors: dict[int, str] | None = None,
        what: str = "prompt",
    ) -> list[RequestOutput]:
        """Run ``prompts[i]`` with ``params[i]``; ``errors[i]``: fail item i with that message
        instead. A failure is logged with the item's index in the caller's list (``what`` i)."""
        engine = self.llm_engine
        errors = errors or {}
        for sp in params:
            if not isinstance(sp, SamplingParams):
                raise TypeError(f"sampling_params must be SamplingParams, got {type(sp).__name__}")
        results: dict[str, RequestOutput] = {}
        order: list[str] = []
        try:
            for index, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
                request_id = f"{self._counter}"
                self._counter += 1
                order.append(request_id)
                error = errors.get(index)
                if error is None:
                    try:
                        engine.add_request(request_id, prompt, sp)
                    except ValueError as exc:
                        error = str(exc)
                if error is not None:
                    logger.warning(
                        "%s at index %d (of %d; request_id %r) failed: %s",
                        what,
                        index,
                        len(prompts),
                        request_id,
                        error,
                    )
                    results[request_id] = _failed_output(request_id, prompt, error)
            with tqdm(
                total=len(prompts),
                desc="Processed prompts",
                disable=not use_tqdm,
                dynamic_ncols=True,
            ) as bar:
                bar.update(len(results))
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        results[out.request_id] = out
                        bar.update(1)
        finally:
            # On an exception or Ctrl-C, leave nothing of this call queued in the engine:
            # a later call would silently compute it.
            for request_id in order:
                if request_id not in results:
                    engine.abort_request(request_id)
        return [results[r] for r in order]


def make_configs(
    model: str | None = None, config: str | os.PathLike | None = None, **kwargs
) -> tuple[EngineConfig, ParallelConfig]:
    """`LLM`'s arguments -> its validated settings, starting nothing: the cluster file's
    (``config``), then ``model`` and ``kwargs`` over them key by key.

    Raises:
        ValueError: an unknown argument or an invalid setting (naming it); a
            `batchgen.cluster_config.ClusterConfigError` for an invalid cluster file.
    """
    engine, parallel, _ = _resolve_configs(model, config, kwargs)
    return engine, parallel


def _check_names(kwargs: dict, allowed: list[str]) -> None:
    """Raises ValueError naming the unknown arguments of ``kwargs``, the allowed name each is
    closest to (``max_num_seq``: did you mean ``max_num_seqs``?) and every allowed name."""
    unknown = sorted(set(kwargs) - set(allowed))
    if not unknown:
        return
    close = {name: close_name(name, allowed) for name in unknown}
    hints = [f"{c!r}" + (f" for {n!r}" if len(unknown) > 1 else "") for n, c in close.items() if c]
    hint = f" (did you mean {', '.join(hints)}?)" if hints else ""
    raise ValueError(f"unknown LLM arguments {unknown}{hint}; allowed: {allowed}")


def _resolve_configs(
    model: str | None,
    config: str | os.PathLike | None,
    kwargs: dict,
    this_machine: bool = False,
) -> tuple[EngineConfig, ParallelConfig, list[str]]:
    """`make_configs`, and one sentence per key of the cluster file that a setting given
    replaces (`ClusterConfig.merge`). With a cluster file, an invalid combination raises a
    `ClusterConfigError` saying where each setting it names comes from (`ClusterConfig.explain`).

    ``this_machine``: also check that this machine can start the job, before any rank does:
    ``device='cuda'`` needs CUDA, and the ranks started here a CUDA device each."""
    engine_fields, parallel_fields = EngineConfig.field_names(), ParallelConfig.field_names()
    if "tensor_parallel_size" in kwargs:  # vLLM's; 1 is a no-op, others are refused
        kwargs = dict(kwargs)
        check_tensor_parallel_size(kwargs.pop("tensor_parallel_size"))
    kwargs = take_vllm_kwargs(kwargs)  # trust_remote_code=True, quantization=None, ...
    _check_names(kwargs, engine_fields + parallel_fields)
    cluster, notes = None, []
    if config is not None:
        from batchgen.cluster_config import load_cluster_config

        cluster = load_cluster_config(config)
        given = kwargs if model is None else {**kwargs, "model": model}
        kwargs, notes = cluster.merge(given)
        model = kwargs.pop("model")
    try:
        engine = EngineConfig(
            model=model, **{k: v for k, v in kwargs.items() if k in engine_fields}
        )
        parallel = ParallelConfig(**{k: v for k, v in kwargs.items() if k in parallel_fields})
        if this_machine:
            from batchgen.distributed.layout import check_device_available, check_local_devices

            check_device_available(engine.device)
            if parallel.is_distributed:
                check_local_devices(parallel, engine.device)
    except ValueError as err:
        if cluster is None:
            raise
        raise cluster.explain(err, given, kwargs) from None
    return engine, parallel, notes


def _params_per_prompt(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
) -> list[SamplingParams]:
    """One `SamplingParams` per prompt (the default, or one given for all, repeated)."""
    if sampling_params is None:
        sampling_params = SamplingParams()
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    params = list(sampling_params)
    if len(params) != num_prompts:
        raise ValueError(
            f"got {len(params)} sampling_params for {num_prompts} prompts; "
            "pass one, or one per prompt"
        )
    return params


def _failed_output(request_id: str, prompt: PromptType, error: str) -> RequestOutput:
    ids = prompt.get("prompt_token_ids", []) if isinstance(prompt, dict) else prompt
    return RequestOutput(
        request_id,
        prompt if isinstance(prompt, str) else None,
        list(ids) if isinstance(ids, (list, tuple)) else [],
        [],
        finished=True,
        error=error,
    )

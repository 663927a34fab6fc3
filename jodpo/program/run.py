"""What the training loop needs, built once from the config: models (sharded over the mesh), data, rewards,
the static step config, the batch and schedule arithmetic."""
from __future__ import annotations

import dataclasses
import functools
import math
import warnings

import jax
import numpy as np
from jax.sharding import Mesh

from jodpo import collective_order
from jodpo.errors import ConfigError
from jodpo.program import backend, trl_fields
from jodpo.program import data as D
from jodpo.parallel import sharding as S
from jodpo import train_step as ts
from jodpo import judges as J
from jodpo.program.config import TrainConfig
from jodpo.losses import LossOptions, needs_reference
from jodpo.models import load_tokenizer
from jodpo.models import lora
from jodpo.models.loading import ready_tokenizer
from jodpo.models.params import frozen_params, param_shapes
from jodpo.optim import restarted
from jodpo.models.params import buffers
from jodpo.program.rewards import RewardSet
from jodpo.program.schedule import Schedule
from jodpo.program.sources import (Given, check_lora_reference, describe_policy, eval_sets, load_judge, load_rewards,
                                   load_split, named, prompt_bos, read_policy, say_attention)
from jodpo.sampling import SamplingConfig


@dataclasses.dataclass(frozen=True)
class Run:
    """What the loop needs, built once from the config; nothing changes it afterwards."""

    cfg: TrainConfig
    tokenizer: object
    step_cfg: ts.StepConfig
    mesh: Mesh
    policy_params: dict | None  # the policy's starting parameters (the reference's own arrays when the dtypes agree),
    # or with LoRA its fresh adapters (the reference is then the base they ride on); None while unread: in
    # param_dtype apart from the reference (or with no reference at all), they are read when the run starts from
    # them (``policy()``), never when it resumes from a checkpoint
    ref_params: dict | None  # the frozen reference (with LoRA the base the adapters ride on); None with a
    # reference-free loss (simpo) without LoRA: nothing of a second model is read or held
    rewards: RewardSet | None  # None with a judge, and for offline DPO
    judge: J.LLMJudge | J.CallableJudge | None
    train: D.PromptData | D.PreferenceData
    evals: tuple[tuple[str, D.PromptData], ...]  # the evaluation sets with their metrics' prefix: ("eval", set), or
    # ("eval_<name>", set) for each of a dict of sets (transformers' naming); the evaluation reads ``eval``
    buckets: tuple[int, ...]
    global_batch: int
    steps_per_epoch: int
    total_steps: int
    schedule: Schedule  # when the run logs, evaluates and saves (the strategies)
    lora_targets: tuple[str, ...] = ()  # the adapted HF modules (use_peft)
    sampler_mesh: Mesh | None = None  # sampler_devices: the devices that sample, apart from ``mesh``
    policy_source: object = None  # where ``policy()`` reads the policy: model_name_or_path, or the caller's object
    layout: object = None  # the first TrainState as ShapeDtypeStructs laid out as the steps' outputs (``with_steps``)
    steps: ts.JittedSteps | None = None  # the steps, jitted for that layout

    @property
    def eval(self) -> D.PromptData | None:
        """The evaluation set the evaluation reads (the first; ``one_eval`` gives a run for each)."""
        return self.evals[0][1] if self.evals else None

    @property
    def eval_prefix(self) -> str:
        return self.evals[0][0] if self.evals else "eval"

    def one_eval(self, i: int) -> "Run":
        """This run evaluating its ``i``-th evaluation set alone."""
        return dataclasses.replace(self, evals=(self.evals[i],))

    def indices(self, step: int) -> np.ndarray:
        """The training rows of step ``step`` (a fresh permutation every epoch, from the seed)."""
        return D.batch_indices(len(self.train), self.global_batch, self.cfg.seed, step)

    def prompts(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """i32[A, B, P] host ids and mask of the prompts of rows ``idx``, in the step's micro-batches."""
        return D.prompt_batch([self.train.ids[i] for i in idx], self.cfg.micro_batches, self.buckets,
                              self.step_cfg.sampling.pad_token_id)

    def policy(self) -> dict:
        """The policy's starting parameters, read in ``param_dtype`` now if ``build`` did not (the caller holds
        them: the run keeps none)."""
        if self.policy_params is not None:
            return self.policy_params
        return read_policy(self.policy_source, self.cfg.param_dtype, self.cfg, self.mesh)[1]

    def policy_shapes(self):
        """What ``jax.eval_shape`` needs of ``policy()``, without reading anything: its arrays once read, else
        their ShapeDtypeStructs."""
        if self.policy_params is None:
            return param_shapes(self.step_cfg.model, self.cfg.param_dtype)
        return self.policy_params

    def trainable_shardings(self):
        """Shardings of what the optimizer trains: the policy's parameters, or its LoRA adapters."""
        model = self.step_cfg.model
        specs = lora.adapter_specs(model, self.lora_targets) if self.lora_targets else None
        return S.param_shardings(model, self.mesh, specs)

    def put(self, x: np.ndarray, mesh: Mesh | None = None) -> jax.Array:
        """A batch array [A, B, ...] (the same on every process) placed with B split over data x fsdp of ``mesh``
        (the training mesh by default)."""
        return S.put(x, self.abstract(x, mesh).sharding)

    def abstract(self, x: np.ndarray, mesh: Mesh | None = None) -> jax.ShapeDtypeStruct:
        """What ``put`` would make of ``x`` (shape, dtype, sharding), with nothing placed on a device: for compiling
        ahead (``training_eval.compile_evaluation``)."""
        mesh = self.mesh if mesh is None else mesh
        dp = S.data_parallel_size(mesh)
        if x.shape[1] % dp:
            raise S.MeshError(f"a batch of {x.shape[1]} rows cannot be split over the {dp} data-parallel devices "
                              "(mesh_data x mesh_fsdp x mesh_expert); use a batch size that is a multiple of it")
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=S.batch_sharding(mesh, x.ndim))

    def decode(self, tokens: np.ndarray) -> list[str]:
        """The texts of ``[..., T]`` token ids (special tokens left out)."""
        return self.tokenizer.batch_decode(tokens.reshape(-1, tokens.shape[-1]), skip_special_tokens=True)

    def score_on_host(self, data: D.PromptData, rows: list, tokens: np.ndarray, tmask: np.ndarray,
                      need_signal: bool = False) -> np.ndarray:
        """f32[N] rewards of N sampled completions ``[N, T]`` of the prompts ``rows``, on the host (functions, other
        tokenizers, chat data); every process scores the whole batch, so every process holds the same rewards.
        ``need_signal``: a batch without a single reward is a ``RewardError`` (``RewardSet.score``)."""
        prompts = [data.prompts[i] for i in rows]
        columns = {k: [v[i] for i in rows] for k, v in data.columns.items()}
        completion_ids = [t[m > 0].tolist() for t, m in zip(tokens, tmask)]
        return self.rewards.score(prompts, self.decode(tokens), completion_ids, columns, need_signal=need_signal)

    def restart_optimizer(self, state):
        """``state`` restored without its optimizer state (a ``save_only_model`` checkpoint), with a new one laid
        out as the steps expect it (``optim.restarted``: AdamW's moments from zero, the schedule where the run is)."""
        fresh = collective_order.jit(
            functools.partial(restarted, self.step_cfg.optimizer, frozen=buffers(self.step_cfg.model)),
            out_shardings=jax.tree.map(lambda x: x.sharding, self.layout.opt_state))
        return state.replace(opt_state=fresh(state.params, state.step))


def build(cfg: TrainConfig, given: Given = Given()) -> Run:
    """The run ``cfg`` describes, with what ``given`` holds in place of what the config names."""
    source = cfg.model_name_or_path if given.model is None else given.model
    if given.model is None and not cfg.model_name_or_path:
        raise ConfigError("model_name_or_path is empty: give a local HF checkpoint directory or a hub id")
    if cfg.attn_implementation == "cudnn" and jax.default_backend() != "gpu":
        raise ConfigError(f"attn_implementation='cudnn' needs an NVIDIA GPU, and jax's backend is "
                          f"{jax.default_backend()}: use 'xla'")
    if cfg.attn_implementation == "splash" and jax.default_backend() not in ("tpu", "cpu"):
        raise ConfigError(f"attn_implementation='splash' compiles for TPUs (on a CPU it runs interpreted, for tests), "
                          f"and jax's backend is {jax.default_backend()}: use 'xla', 'cudnn' or 'auto'")
    if cfg.decode_attn_implementation == "pallas" and jax.default_backend() not in ("tpu", "cpu"):
        raise ConfigError(f"decode_attn_implementation='pallas' compiles for TPUs (on a CPU it runs interpreted, for "
                          f"tests), and jax's backend is {jax.default_backend()}: use 'xla' or 'auto'")
    if cfg.temperature == 0 and (cfg.reward_model_path or cfg.reward_funcs or cfg.judge):  # online: it samples
        raise ConfigError("temperature=0 decodes greedily, so both completions of a prompt are the same: every pair "
                          "ties, the loss stays ln 2 and nothing is learned; use a temperature > 0 (TRL's default "
                          "0.9). Greedy decoding is for evaluation (jodpo.sample with temperature=0)")
    mesh, sampler_mesh = meshes(cfg)
    dp = S.data_parallel_size(mesh)
    with named("model_name_or_path"):
        tokenizer = ready_tokenizer(given.tokenizer, "processing_class") if given.tokenizer is not None else \
            load_tokenizer(cfg.model_name_or_path, cfg.model_revision)
    D.set_chat_template(tokenizer, cfg.chat_template_path)
    describe_policy(source, cfg.param_dtype, cfg)  # an architecture jodpo does not implement: said before the data
    # The data before the models: a dataset that cannot be used is said in seconds, not after the weights are read
    train_rows = given.train_rows if given.train_rows is not None else load_split(
        cfg.dataset_mixer, cfg.dataset_name, cfg, cfg.dataset_train_split)
    # A preference dataset (prompt/chosen/rejected) trains offline DPO, unless the run has a reward or a judge: then
    # its prompts train online DPO, as TRL's and open-instruct's online trainers read only the prompts.
    offline = D.is_preference(train_rows) and not (cfg.reward_model_path or cfg.reward_funcs or cfg.judge)
    if offline:
        train = D.prepare_preferences(train_rows, tokenizer, cfg.max_prompt_length, cfg.max_new_tokens)
    else:
        train = D.prepare_prompts(train_rows, tokenizer, cfg.max_prompt_length, prompt_bos(cfg, tokenizer))
    evaluation = eval_sets(cfg, given, tokenizer, dp, offline)
    if given.ref_model is not None and not needs_reference(cfg.loss_type):
        raise ConfigError(f"ref_model: with loss_type={cfg.loss_type!r} no reference is run; leave ref_model None")
    own_reference = given.ref_model is not None and not cfg.use_peft  # with LoRA the base is the reference
    if needs_reference(cfg.loss_type) or cfg.use_peft:
        model, ref_params = read_policy(given.ref_model if own_reference else source, cfg.frozen_param_dtype, cfg,
                                        mesh)
        if given.ref_model is not None:  # a reference of its own: the policy is read from its source (Run.policy)
            policy = describe_policy(source, cfg.frozen_param_dtype, cfg)
            reference = model if own_reference else describe_policy(given.ref_model, cfg.frozen_param_dtype, cfg)
            if policy.family != reference.family or param_shapes(policy) != param_shapes(reference):
                raise ConfigError(f"ref_model is a {reference.family} model of other shapes than the policy "
                                  f"({policy.family}); give a reference of the policy's architecture and size")
            model = policy
        if given.ref_model is not None and cfg.use_peft:
            check_lora_reference(given.ref_model, source, ref_params, cfg, mesh)
    else:  # reference-free (simpo): only the policy, read in param_dtype when the run starts from it (Run.policy)
        model, ref_params = describe_policy(source, cfg.param_dtype, cfg), None
    policy_params, targets = ref_params, ()
    if cfg.router_aux_loss_coef and model.moe is None:  # as TRL refuses it
        raise ConfigError(f"router_aux_loss_coef={cfg.router_aux_loss_coef} adds a mixture of experts' load-balancing "
                          f"loss, and this {model.family} policy has no experts; leave it at 0")
    if cfg.router_aux_loss_coef and not model.moe.aux_loss:  # transformers' forward computes none to add
        raise ConfigError(f"router_aux_loss_coef={cfg.router_aux_loss_coef}: transformers computes no load-balancing "
                          f"loss for {model.family}'s experts; leave it at 0")
    if cfg.moe_routing_replay and model.moe is None:
        raise ConfigError(f"moe_routing_replay=True replays the experts a mixture of experts' sampler chose, and this "
                          f"{model.family} policy has no experts; leave it False")
    if cfg.use_peft:  # the policy is the frozen base plus adapters; nothing else is trained or copied
        model = model.replace(lora_rank=cfg.lora_r, lora_alpha=float(cfg.lora_alpha))
        try:
            targets = lora.resolve_targets(model, cfg.lora_target_modules, cfg.lora_target_parameters)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        policy_params = lora.init_adapters(model, targets, jax.random.fold_in(jax.random.PRNGKey(cfg.seed), 1),
                                           cfg.param_dtype)
    elif cfg.param_dtype != cfg.frozen_param_dtype or given.ref_model is not None:  # read again (so neither copy
        # is rounded through the other), or the policy's own weights when the reference is another model
        policy_params = None  # when the run starts from it: Run.policy()
    remat = cfg.remat if cfg.remat != "auto" else ("full" if cfg.gradient_checkpointing else "none")
    model = model.replace(dtype="bfloat16" if cfg.bf16 else "float32", remat=remat, precision=cfg.matmul_precision,
                          attention=backend.attention_kernel(cfg, model),
                          decode_attention=backend.decode_attention_kernel(cfg))
    say_attention(model, "model_name_or_path")
    # the reference as its bf16 forwards read it (the same numbers; with LoRA the base stays as loaded, since the
    # adapters are merged into it in float32); the policy's own copy (policy_params) is untouched
    ref_params = None if ref_params is None else frozen_params(model, ref_params)
    eos = tuple(dict.fromkeys([*model.eos_token_ids, *([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None
                                                       else [])]))
    pad = tokenizer.pad_token_id
    stop = stop_token_ids(cfg, tokenizer)
    eos = tuple(dict.fromkeys([*eos, *stop]))

    rewards, rm, judge = None, None, None
    if not offline and cfg.judge:
        judge = load_judge(cfg, model, mesh, given.judge)
        if any(data.references is None for _, data in evaluation):
            warnings.warn("with a judge, evaluation needs reference completions to judge against (a 'completion' "
                          "column); an evaluation set without them is not evaluated", stacklevel=2)
            evaluation = tuple((p, data) for p, data in evaluation if data.references is not None)
    elif not offline:
        rewards = load_rewards(cfg, model, tokenizer, mesh, chat=isinstance(train.prompts[0], list), given=given)
        rm = rewards.model

    global_batch = cfg.per_device_train_batch_size * dp * cfg.micro_batches
    updates = cfg.updates_per_step
    if offline and cfg.method != "online_dpo":
        raise ConfigError(f"method={cfg.method!r} samples its pairs and scores them: give a reward or a judge (this "
                          "dataset has chosen/rejected columns, which train offline DPO)")
    if offline and (updates > 1 or cfg.async_mode or sampler_mesh is not None or cfg.num_generations != 2
                    or cfg.pairing != "auto" or cfg.sync_steps != 1):
        raise ConfigError("num_epochs, num_mini_batches, async_mode, sampler_devices, num_generations, pairing and "
                          "sync_steps shape online rollouts; this dataset has chosen/rejected columns (offline DPO): "
                          "leave them at their defaults")
    if offline and cfg.moe_routing_replay:
        raise ConfigError("moe_routing_replay=True replays the experts the sampler chose, and this dataset has "
                          "chosen/rejected columns (offline DPO: nothing is sampled); leave it False")

    spe = D.steps_per_epoch(len(train), global_batch)
    total = run_length(cfg, global_batch, spe)
    warmup = cfg.warmup_steps or math.ceil(total * updates * cfg.warmup_ratio)
    sampling = SamplingConfig(max_new_tokens=cfg.max_new_tokens,
                              temperature=cfg.temperature if trl_fields.do_sample(cfg) else 0.0, top_k=cfg.top_k,
                              top_p=cfg.top_p, min_p=cfg.min_p or 0.0, repetition_penalty=cfg.repetition_penalty,
                              eos_token_ids=eos, pad_token_id=pad, chunk=cfg.decode_chunk, slots=cfg.sampler_slots)
    opt = ts.OptimizerConfig(learning_rate=cfg.learning_rate, total_steps=total * updates, warmup_steps=warmup,
                             lr_scheduler_type=cfg.lr_scheduler_type, weight_decay=cfg.weight_decay,
                             adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, adam_epsilon=cfg.adam_epsilon,
                             max_grad_norm=cfg.max_grad_norm)
    step_cfg = ts.StepConfig(
        model=model, sampling=sampling, optimizer=opt, beta=cfg.beta, updates_per_epoch=spe * updates,
        loss_type=cfg.loss_type,
        loss_options=LossOptions(cfg.label_smoothing, cfg.discopop_tau, cfg.ipo_length_normalized, cfg.simpo_gamma,
                                 cfg.rdpo_alpha, cfg.ld_alpha),
        missing_eos_penalty=cfg.missing_eos_penalty,
        penalty_reward_value=cfg.penalty_reward_value if cfg.non_eos_penalty else None, max_length=cfg.max_length,
        reward_model=rm if rewards is not None and rewards.on_device else None, judged=judge is not None,
        logprob_temperature=cfg.temperature if cfg.temperature_scaled_logprobs else None, stop_token_ids=stop,
        async_mode=cfg.async_mode, num_generations=cfg.num_generations, pairing=cfg.pairing,
        sync_steps=cfg.sync_steps, method=cfg.method, alpha=cfg.alpha, mixture_coef=cfg.mixture_coef,
        router_aux_loss_coef=cfg.router_aux_loss_coef, moe_routing_replay=cfg.moe_routing_replay)
    run = Run(cfg, tokenizer, step_cfg, mesh, policy_params, ref_params, rewards, judge, train, evaluation,
              cfg.prompt_buckets or D.default_buckets(cfg.max_prompt_length), global_batch, spe, total,
              Schedule(cfg, total, spe),
              lora_targets=targets, sampler_mesh=sampler_mesh, policy_source=source)
    return with_steps(run)


def with_steps(run: Run) -> Run:
    """The run with its first state's layout and its steps jitted for it: what a checkpoint is restored into and
    what ``loop.initial_state`` fills (shapes, dtypes, shardings; nothing computed or allocated)."""
    init = functools.partial(ts.init_state, run.step_cfg)
    shapes = jax.eval_shape(init, run.policy_shapes(), jax.random.PRNGKey(run.cfg.seed))
    sharding = S.like_params(shapes, run.trainable_shardings(), run.mesh)
    layout = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, sharding)
    return dataclasses.replace(run, layout=layout, steps=ts.jit_steps(sharding, S.replicated(run.mesh)))


def meshes(cfg: TrainConfig) -> tuple[Mesh, Mesh | None]:
    """The training mesh (mesh_data x mesh_fsdp x mesh_expert x mesh_tensor), and with ``sampler_devices`` = k the
    sampler's mesh on the last k devices, apart: data-parallel, with the training mesh's tensor and expert splits (a
    mixture of experts' experts split by expert there too, each decode step's tokens reaching them as in training;
    the weights otherwise whole on each sampler device: decoding gathers nothing)."""
    devices = jax.devices()
    k = cfg.sampler_devices
    if not k:
        return S.make_mesh(cfg.mesh_data, cfg.mesh_fsdp, cfg.mesh_tensor, devices, expert=cfg.mesh_expert), None
    if jax.process_count() > 1:
        raise ConfigError(f"sampler_devices={k} needs a single-process run: JAX moves arrays between disjoint sets of "
                          "devices only within one process (one host's devices); leave it at 0 in a multi-process "
                          "run")
    if k >= len(devices):
        raise ConfigError(f"sampler_devices={k} leaves none of the {len(devices)} devices to train on; use fewer "
                          "(or 0 to sample on the training devices)")
    mesh = S.make_mesh(cfg.mesh_data, cfg.mesh_fsdp, cfg.mesh_tensor, devices[:len(devices) - k],
                       expert=cfg.mesh_expert)
    tensor, expert = mesh.shape["tensor"], mesh.shape["expert"]
    if k % (tensor * expert):
        raise ConfigError(f"sampler_devices={k} is not a multiple of the training mesh's tensor x expert size "
                          f"{tensor} x {expert} (the sampler splits the weights the same way); choose a multiple")
    sampler = S.make_mesh(-1, 1, tensor, devices[len(devices) - k:], expert=expert)
    rows, dp = cfg.per_device_train_batch_size * S.data_parallel_size(mesh), S.data_parallel_size(sampler)
    if rows % dp:
        raise ConfigError(f"sampler_devices={k}: a micro-batch of {rows} prompts does not split over the sampler's "
                          f"{dp} data-parallel devices; choose sampler_devices (or per_device_train_batch_size) so "
                          "that it does")
    return mesh, sampler


def stop_token_ids(cfg: TrainConfig, tokenizer) -> tuple[int, ...]:
    """open-instruct's ``stop_token``: None or ``"eos"``, completions end at the EOS (as in TRL; nothing to add);
    ``"period"``, also at the first "." token, which alone then spares a completion the EOS penalties."""
    if cfg.stop_token in (None, "eos"):
        return ()
    ids = tokenizer.encode(".", add_special_tokens=False)
    if len(ids) != 1:
        raise ConfigError(f"stop_token='period': '.' is {len(ids)} tokens for this tokenizer, not one")
    return (ids[0],)


def run_length(cfg: TrainConfig, global_batch: int, steps_per_epoch: int) -> int:
    """Optimizer steps of the run: ``max_steps``, or ``total_episodes // global_batch`` (open-instruct's run length;
    the prompts are reshuffled at each pass, as open-instruct retrains on them), or ``num_train_epochs`` passes."""
    if cfg.max_steps > 0:
        return cfg.max_steps
    if cfg.total_episodes is not None:
        if cfg.total_episodes < global_batch:
            raise ConfigError(f"total_episodes={cfg.total_episodes} is less than one step's {global_batch} prompts "
                              "(per_device_train_batch_size x data-parallel devices x gradient_accumulation_steps)")
        return cfg.total_episodes // global_batch
    return math.ceil(cfg.num_train_epochs * steps_per_epoch)

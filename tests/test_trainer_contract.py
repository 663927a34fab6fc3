"""TRL's own tests of its trainers (huggingface/trl tests/experimental/test_online_dpo_trainer.py,
test_nash_md_trainer.py, test_xpo_trainer.py) as jodpo's trainers meet them: the same constructor calls and the same
assertions, with the import changed and local tiny checkpoints in place of trl-internal-testing's (nothing from the
Hub): TRL's Qwen2 policy and Llama reward model are the suite's, its "zen" prompt-only dataset hf_fixtures'."""
import pytest
from datasets import Dataset

import jodpo
from jodpo import NashMDConfig, NashMDTrainer, OnlineDPOConfig, OnlineDPOTrainer, XPOConfig, XPOTrainer
from tests import hf_fixtures

# what keeps a training test tiny (TRL's tests run 3 steps of TRL's defaults on tiny models)
TINY = dict(max_new_tokens=4, max_length=96, max_prompt_length=64, prompt_buckets=[64], bf16=False, logging_steps=1)


class Setup:
    """TRL's ``setup_method``: the policy, a reference copy, the reward model and their tokenizers, as objects."""

    def __init__(self, checkpoints, root):
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

        self.model_id = str(checkpoints["qwen2"]["causal_lm"])
        self.model = AutoModelForCausalLM.from_pretrained(self.model_id, dtype="float32")
        self.ref_model = AutoModelForCausalLM.from_pretrained(self.model_id)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_id)
        self.tokenizer.pad_token = self.tokenizer.eos_token
        self.reward_model_id = str(checkpoints["llama"]["reward"])
        self.reward_model = AutoModelForSequenceClassification.from_pretrained(self.reward_model_id, num_labels=1)
        self.reward_tokenizer = AutoTokenizer.from_pretrained(self.reward_model_id)
        self.reward_tokenizer.pad_token = self.reward_tokenizer.eos_token
        data = hf_fixtures.prompt_dataset(root / "zen")
        self.dataset = {s: Dataset.from_json(str(data / f"{s}.jsonl")) for s in ("train", "test")}
        chat = hf_fixtures.prompt_dataset(root / "zen_chat", chat=True)
        self.chat_dataset = {s: Dataset.from_json(str(chat / f"{s}.jsonl")) for s in ("train", "test")}


@pytest.fixture(scope="module")
def trl(checkpoints, tmp_path_factory):
    return Setup(checkpoints, tmp_path_factory.mktemp("trl"))


TRAINERS = {"online_dpo": (OnlineDPOTrainer, OnlineDPOConfig), "nash_md": (NashMDTrainer, NashMDConfig),
            "xpo": (XPOTrainer, XPOConfig)}


@pytest.mark.parametrize("method", list(TRAINERS))
def test_ref_model_is_model(trl, tmp_path, method):
    trainer, config = TRAINERS[method]
    with pytest.raises(ValueError):
        trainer(model=trl.model, ref_model=trl.model,  # ref_model can't be the same as model
                reward_funcs=trl.reward_model, args=config(output_dir=str(tmp_path), per_device_train_batch_size=2,
                                                           max_steps=3, report_to="none"),
                train_dataset=trl.dataset["train"], processing_class=trl.tokenizer)


def _args(config, out, **fields):
    return config(output_dir=str(out), report_to="none", **fields)


@pytest.mark.parametrize("method", list(TRAINERS))
@pytest.mark.parametrize("eval_dataset_type", ["dataset", "dataset_dict", "dict_of_dataset", "none"])
def test_init_with_eval_dataset(trl, tmp_path, method, eval_dataset_type):
    from datasets import DatasetDict

    trainer_class, config = TRAINERS[method]
    dataset = trl.dataset
    if eval_dataset_type == "none":
        eval_dataset = None
    elif eval_dataset_type == "dataset":
        eval_dataset = dataset["test"]
    elif eval_dataset_type == "dataset_dict":
        eval_dataset = DatasetDict({"data1": dataset["test"], "data2": dataset["test"]})
    else:  # "dict_of_dataset"
        eval_dataset = {"data1": dataset["test"], "data2": dataset["test"]}
    trainer = trainer_class(model=trl.model, reward_funcs=trl.reward_model, args=_args(config, tmp_path),
                            train_dataset=dataset["train"], eval_dataset=eval_dataset,
                            processing_class=trl.tokenizer)
    if eval_dataset_type == "none":
        assert trainer.eval_dataset is None
    elif isinstance(trainer.eval_dataset, dict):
        assert set(trainer.eval_dataset.keys()) == {"data1", "data2"}
    else:
        assert trainer.eval_dataset is eval_dataset
    assert trainer.train_dataset is dataset["train"]


def test_vllm_config_validation():
    """TRL's: use_vllm=True is accepted (jodpo's own sampler takes it, below), vLLM's fields read back."""
    config = OnlineDPOConfig(use_vllm=True, vllm_mode="server")
    assert config.vllm_mode == "server"
    config = OnlineDPOConfig(use_vllm=True, vllm_mode="colocate")
    assert config.vllm_mode == "colocate"
    config = OnlineDPOConfig()
    assert config.vllm_mode == "colocate"
    assert config.vllm_server_base_url is None
    assert config.vllm_server_host == "0.0.0.0"
    assert config.vllm_server_port == 8000
    assert config.vllm_server_timeout == 240.0
    assert config.vllm_gpu_memory_utilization == 0.55
    assert config.top_p == 1.0
    assert config.top_k == 0
    assert config.min_p is None
    assert config.repetition_penalty == 1.0
    assert config.cache_implementation is None
    assert config.generation_kwargs is None


def test_generation_config_setup(trl, tmp_path):
    from jodpo.program.run import build

    training_args = OnlineDPOConfig(output_dir=str(tmp_path), use_vllm=False, temperature=0.8, top_p=0.9, top_k=40,
                                    repetition_penalty=1.2, max_new_tokens=64, generation_kwargs={"do_sample": False},
                                    report_to="none")
    trainer = OnlineDPOTrainer(model=trl.model, reward_funcs=trl.reward_model, args=training_args,
                               train_dataset=trl.dataset["train"], processing_class=trl.tokenizer,
                               reward_processing_classes=trl.reward_tokenizer)
    assert not trainer.use_vllm
    assert not (hasattr(trainer, "llm") and trainer.llm is not None)
    assert not (hasattr(trainer, "vllm_client") and trainer.vllm_client is not None)
    assert trainer.generation_config is not None
    assert trainer.generation_config.temperature == 0.8
    assert trainer.generation_config.top_p == 0.9
    assert trainer.generation_config.top_k == 40
    assert trainer.generation_config.repetition_penalty == 1.2
    assert trainer.generation_config.max_new_tokens == 64
    assert not trainer.generation_config.do_sample  # From generation_kwargs
    # and jodpo's sampler decodes greedily, as transformers' generate does with do_sample=False
    assert build(trainer.args, trainer.given).step_cfg.sampling.temperature == 0.0


def test_train_with_vllm_colocate(trl, tmp_path, capsys):
    """TRL's (vLLM's own objects aside: trainer.llm, a SamplingParams' max_tokens): use_vllm=True trains with jodpo's
    sampler at the same settings, said once."""
    training_args = OnlineDPOConfig(output_dir=str(tmp_path), use_vllm=True, vllm_mode="colocate",
                                    vllm_gpu_memory_utilization=0.2, per_device_train_batch_size=1, max_steps=2,
                                    report_to="none", temperature=0.9, top_p=0.95, top_k=50, repetition_penalty=1.1,
                                    **TINY | dict(max_new_tokens=32))
    trainer = OnlineDPOTrainer(model=trl.model, reward_funcs=trl.reward_model, args=training_args,
                               train_dataset=trl.dataset["train"], processing_class=trl.tokenizer,
                               reward_processing_classes=trl.reward_tokenizer)
    assert trainer.use_vllm
    assert trainer.vllm_mode == "colocate"
    assert trainer.temperature == 0.9
    assert trainer.top_p == 0.95
    assert trainer.top_k == 50
    assert trainer.repetition_penalty == 1.1
    assert trainer.generation_config is not None
    assert trainer.generation_config.temperature == 0.9
    assert trainer.generation_config.top_p == 0.95
    assert trainer.generation_config.top_k == 50
    assert trainer.generation_config.repetition_penalty == 1.1
    assert trainer.generation_config.max_new_tokens == 32
    trainer.train()
    assert "train_loss" in trainer.state.log_history[-1]
    said = capsys.readouterr().out
    assert said.count("use_vllm=True is mapped: True is accepted and samples as False does: with jodpo's own JAX "
                      "sampler") == 1


@pytest.mark.parametrize("config_name", ["standard_prompt_only", "conversational_prompt_only"])
def test_train_with_reward_funcs(trl, tmp_path, config_name):
    def simple_reward_func(prompts, completions, completion_ids, **kwargs):
        return [0.5 for _ in prompts]

    training_args = OnlineDPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=3,
                                    learning_rate=5.0e-7, reward_weights=[0.7, 0.3], report_to="none", **TINY)
    dataset = trl.dataset if config_name == "standard_prompt_only" else trl.chat_dataset
    trainer = OnlineDPOTrainer(model=trl.model, reward_funcs=[simple_reward_func, simple_reward_func],
                               args=training_args, train_dataset=dataset["train"], processing_class=trl.tokenizer)
    trainer.train()
    assert "train_loss" in trainer.state.log_history[-1]
    assert len(trainer.reward_funcs) == 2
    assert trainer.reward_weights is not None
    assert round(abs(trainer.reward_weights[0].item() - 0.7), 5) == 0
    assert round(abs(trainer.reward_weights[1].item() - 0.3), 5) == 0


def test_trust_remote_code(trl, checkpoints, tmp_path):
    """TRL's, on a local copy of the policy whose config.json maps AutoModelForCausalLM to code of its own (as
    trl-internal-testing/tiny-RemoteForCausalLM's does): refused without trust_remote_code when the trainer is built;
    with it, jodpo trains the checkpoint as its own implementation of the model_type (TRL's trainer.model is the
    remote class; jodpo runs no checkpoint's code), said once."""
    import json
    import shutil

    model_id = tmp_path / "tiny-RemoteForCausalLM"
    shutil.copytree(checkpoints["qwen2"]["causal_lm"], model_id)
    config = json.loads((model_id / "config.json").read_text())
    config |= {"architectures": ["RemoteForCausalLM"],
               "auto_map": {"AutoModelForCausalLM": "modeling_remote.RemoteForCausalLM"}}
    (model_id / "config.json").write_text(json.dumps(config))
    dataset = trl.dataset["train"]
    with pytest.raises(ValueError, match="custom code"):
        OnlineDPOTrainer(model=str(model_id), reward_funcs=trl.reward_model,
                         args=OnlineDPOConfig(output_dir=str(tmp_path), report_to="none"), train_dataset=dataset,
                         processing_class=trl.tokenizer, reward_processing_classes=trl.reward_tokenizer)
    with pytest.warns(UserWarning, match="jodpo trains it as its own implementation of the checkpoint's model_type"):
        trainer = OnlineDPOTrainer(model=str(model_id), reward_funcs=trl.reward_model,
                                   args=OnlineDPOConfig(output_dir=str(tmp_path), report_to="none",
                                                        trust_remote_code=True),
                                   train_dataset=dataset, processing_class=trl.tokenizer,
                                   reward_processing_classes=trl.reward_tokenizer)
    assert trainer.model[0].family == "qwen2"  # TRL's: type(trainer.model).__name__ == "RemoteForCausalLM"


def test_the_model_is_read_when_the_trainer_is_built(trl, tmp_path):
    """TRL's constructor loads a model given by name: trainer.model is the model (jodpo's (Model, params), on the host)
    and trainer.processing_class its tokenizer from then on, and a path that holds no model is said there."""
    import jax
    import numpy as np

    from jodpo.errors import CheckpointError

    trainer = OnlineDPOTrainer(model=trl.model_id, reward_funcs=trl.reward_model,
                               args=OnlineDPOConfig(output_dir=str(tmp_path), report_to="none"),
                               train_dataset=trl.dataset["train"])
    model, params = trainer.model
    assert model.family == "qwen2" and all(isinstance(x, np.ndarray) for x in jax.tree.leaves(params))
    assert trainer.processing_class.eos_token_id == trainer.eos_token_ids[0]
    with pytest.raises(CheckpointError, match="not a model directory"):
        OnlineDPOTrainer(model=str(tmp_path / "nothing"), reward_funcs=trl.reward_model,
                         args=OnlineDPOConfig(output_dir=str(tmp_path), report_to="none"))


@pytest.mark.parametrize("method", list(TRAINERS))
def test_train_with_peft_and_ref_model(trl, tmp_path, method):
    """TRL's (all three trainers): a ref_model beside peft_config (TRL's: the policy's checkpoint again) trains; it
    was refused. jodpo's LoRA reference is the base with its adapters off, which this reference is (one of other
    weights is refused: tests/test_trainer.py)."""
    from peft import LoraConfig

    trainer_class, config = TRAINERS[method]
    lora_config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, bias="none", task_type="CAUSAL_LM")
    training_args = config(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=3,
                           learning_rate=5.0e-7, report_to="none", **TINY)
    trainer = trainer_class(model=trl.model, ref_model=trl.ref_model, reward_funcs=trl.reward_model,
                            args=training_args, processing_class=trl.tokenizer, train_dataset=trl.dataset["train"],
                            peft_config=lora_config)
    trainer.train()
    assert "train_loss" in trainer.state.log_history[-1]


@pytest.mark.parametrize("method", ["nash_md", "xpo"])
def test_train_pre_pefted_model_implicit_ref(trl, tmp_path, method):
    """TRL's (Nash-MD's and XPO's): a model already wrapped by get_peft_model trains its adapters, the reference its
    base; it failed with a CheckpointError ("config.json and the weights disagree")."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    trainer_class, config = TRAINERS[method]
    lora_config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1, bias="none", task_type="CAUSAL_LM")
    model = AutoModelForCausalLM.from_pretrained(trl.model_id, dtype="float32")  # get_peft_model changes it
    peft_model_instance = get_peft_model(model, lora_config)
    training_args = config(output_dir=str(tmp_path), per_device_train_batch_size=1, max_steps=2,
                           learning_rate=5.0e-7, eval_strategy="no", report_to="none", remove_unused_columns=False,
                           **TINY)
    with pytest.warns(UserWarning, match="model is a peft model: jodpo trains LoRA adapters of its config"):
        trainer = trainer_class(model=peft_model_instance, ref_model=None, reward_funcs=trl.reward_model,
                                args=training_args, processing_class=trl.tokenizer, train_dataset=trl.dataset["train"])
    assert (trainer.args.use_peft, trainer.args.lora_r, trainer.args.lora_alpha) == (True, 8, 16)
    assert trainer.args.lora_target_modules == ("q_proj", "v_proj")  # what get_peft_model resolved for Qwen2
    trainer.train()
    assert "train_loss" in trainer.state.log_history[-1]
    adapter = trainer.save_model(str(tmp_path / "adapter"))
    assert (adapter / "adapter_config.json").is_file()


def test_a_peft_model_read_as_weights_says_what_to_give(trl):
    """jodpo.load_model of a peft model (the functional API, or as a ref_model): one line saying what to give, not a
    CheckpointError about config.json."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from jodpo.errors import CheckpointError

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(trl.model_id), LoraConfig(r=2, lora_alpha=4))
    with pytest.raises(CheckpointError, match=r"is a peft model \(LoRA layers injected\); give "
                                              r"model.merge_and_unload\(\)"):
        jodpo.load_model(model)


class TestGeometricMixtureWrapper:
    """TRL's (trl.experimental.nash_md.nash_md_trainer.GeometricMixtureWrapper, now jodpo.GeometricMixtureWrapper;
    it was missing), with TRL's assertions: torch tensors in, torch tensors out. tests/test_trl112.py checks its
    greedy generate against TRL 1.12's recorded wrapper."""

    @pytest.fixture(autouse=True)
    def setup_method(self, trl):
        import copy

        import torch
        from transformers import GenerationConfig

        self.device = "cpu"
        self.model = trl.model
        self.ref_model = copy.deepcopy(self.model).eval()  # TRL's create_reference_model: a frozen copy
        self.generation_config = GenerationConfig.from_pretrained(trl.model_id)
        self.mixture_coef = 0.5
        self.wrapper = jodpo.GeometricMixtureWrapper(self.model, self.ref_model, self.generation_config,
                                                     mixture_coef=self.mixture_coef)
        self.torch = torch

    def test_forward(self):
        torch = self.torch
        input_ids = torch.tensor([[1, 2, 3, 4, 5]], device=self.device)
        attention_mask = torch.ones_like(input_ids)
        output = self.wrapper(input_ids=input_ids, attention_mask=attention_mask)
        assert output is not None
        assert hasattr(output, "logits")
        assert output.logits.shape == (1, 5, self.model.config.vocab_size)

    def test_mixture_coefficient(self):
        torch = self.torch
        input_ids = torch.tensor([[1, 2, 3, 4, 5]], device=self.device)
        attention_mask = torch.ones_like(input_ids)
        with torch.no_grad():
            model_output = self.model(input_ids=input_ids, attention_mask=attention_mask)
            ref_model_output = self.ref_model(input_ids=input_ids, attention_mask=attention_mask)
            wrapper_output = self.wrapper(input_ids=input_ids, attention_mask=attention_mask)
        expected_logits = torch.nn.functional.log_softmax(
            self.mixture_coef * ref_model_output.logits + (1 - self.mixture_coef) * model_output.logits, dim=-1)
        torch.testing.assert_close(wrapper_output.logits, expected_logits)

    def test_prepare_inputs_for_generation(self):
        torch = self.torch
        input_ids = torch.tensor([[1, 2, 3, 4, 5]], device=self.device)
        attention_mask = torch.ones_like(input_ids)
        inputs = self.wrapper.prepare_inputs_for_generation(input_ids, attention_mask=attention_mask, use_cache=True)
        assert "input_ids" in inputs
        assert "attention_mask" in inputs
        assert not inputs.get("use_cache", False)

    def test_generate_greedily_is_the_argmax_of_the_mixture_each_step(self):
        """jodpo's: ``generate`` (do_sample=False) continues the prompt by the argmax of the mixture's forward at each
        step, what transformers' generate does through TRL's wrapper."""
        import numpy as np

        ids = np.array([[1, 2, 3, 4, 5]], np.int32)
        out = self.wrapper.generate(ids, generation_config=self.generation_config, max_new_tokens=4,
                                    do_sample=False, eos_token_id=[])
        assert out.shape == (1, 9) and (out[:, :5] == ids).all()
        for t in range(5, 9):
            assert out[0, t] == int(np.argmax(self.wrapper(out[:, :t]).logits[0, -1]))


def test_reward_weights_that_do_not_match_the_rewards(tmp_path):
    """TRL's constructor's ValueError, said before the model is read (TRL's order): here the model does not exist."""
    def reward(completions, **kwargs):
        return [0.0 for _ in completions]

    with pytest.raises(ValueError, match=r"Number of reward weights \(1\) must match number of reward functions "
                                         r"\(2\)"):
        OnlineDPOTrainer(model=str(tmp_path / "not-read"), reward_funcs=[reward, reward],
                         args=OnlineDPOConfig(output_dir=str(tmp_path), reward_weights=[1.0], report_to="none"))

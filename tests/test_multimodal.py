"""The ``*ForConditionalGeneration`` families (Qwen3.5, Gemma 3, Gemma 4): jodpo loads their language model with the
LM head tied exactly as transformers resolves it, whatever config.json says where: transformers ties by the top-level
config's ``tie_word_embeddings`` (its class default where config.json has none), never by ``text_config``'s. Each
placement of the flag, against the multimodal model transformers itself loads from the same directory: logits on
text, and the export read back. Then a tied multimodal Qwen3.5 as the small Qwen3.5 models ship trains 3 steps and
exports (issue 59)."""
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import jodpo
from jodpo import train
from tests import hf_fixtures, references
from tests.helpers import export_hf


def _qwen3_5(text: dict, tie: dict):
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3_5VisionConfig

    vision = Qwen3_5VisionConfig(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4,
                                 out_hidden_size=text["hidden_size"], num_position_embeddings=16)
    V = text["vocab_size"]
    cfg = Qwen3_5Config(text_config=text, vision_config=vision.to_dict(), image_token_id=V - 1, video_token_id=V - 2,
                        vision_start_token_id=V - 3, vision_end_token_id=V - 4, **tie)
    return Qwen3_5ForConditionalGeneration(cfg)


def _gemma3(text: dict, tie: dict):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    V = text["vocab_size"]
    cfg = Gemma3Config(text_config=text, vision_config=vision.to_dict(), mm_tokens_per_image=4,
                       image_token_index=V - 1, boi_token_index=V - 3, eoi_token_index=V - 2, **tie)
    return Gemma3ForConditionalGeneration(cfg)


def _gemma4(text: dict, tie: dict):
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration, Gemma4VisionConfig

    vision = Gemma4VisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=2, head_dim=8, patch_size=4, position_embedding_size=64)
    V = text["vocab_size"]
    cfg = Gemma4Config(text_config=text, vision_config=vision.to_dict(), image_token_id=V - 1, video_token_id=V - 2,
                       audio_token_id=V - 3, boi_token_id=V - 4, eoi_token_id=V - 5, boa_token_id=V - 6,
                       eoa_token_index=V - 7, **tie)
    return Gemma4ForConditionalGeneration(cfg)


BUILDERS = {"qwen3_5": (_qwen3_5, "Qwen3_5ForCausalLM"), "gemma3": (_gemma3, "Gemma3ForCausalLM"),
            "gemma4": (_gemma4, "Gemma4ForCausalLM")}
# Where config.json holds the flag (top level, text_config; None: not there) -> whether transformers ties
PLACEMENTS = {"top_only": (True, None), "text_only": (None, "not default"), "both_agree": (False, False),
              "both_differ": (True, False)}


def multimodal(family: str, checkpoints, out, top: bool | None, text: bool | str | None):
    """A tiny random ``*ForConditionalGeneration`` of ``family`` (the suite's text model beside one-layer towers)
    saved to ``out`` with the tying flag where ``top``/``text`` say (None: removed from config.json; "not default":
    the text flag the opposite of the top-level class default); returns (the model transformers loads from ``out``,
    whether it ties)."""
    build, _ = BUILDERS[family]
    text_cfg = AutoModelForCausalLM.from_pretrained(checkpoints[family]["causal_lm"]).config.to_dict()
    torch.manual_seed(0)
    hf = build(text_cfg, {} if top is None else {"tie_word_embeddings": top})  # None: the class's default
    tied = hf.config.tie_word_embeddings
    hf = hf_fixtures.randomize(hf)
    hf.save_pretrained(out)  # as transformers saves it (tied: no lm_head)
    AutoTokenizer.from_pretrained(checkpoints[family]["causal_lm"]).save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    if top is None:
        del config["tie_word_embeddings"]
    if text == "not default":
        text = not tied
    if text is None:
        config["text_config"].pop("tie_word_embeddings", None)
    else:
        config["text_config"]["tie_word_embeddings"] = text
    (out / "config.json").write_text(json.dumps(config))
    loaded = type(hf).from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    return loaded, tied


@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("family", list(BUILDERS))
def test_conditional_generation_ties_its_head_as_transformers_does(checkpoints, tmp_path, family, placement):
    hf, tied = multimodal(family, checkpoints, tmp_path / "mm", *PLACEMENTS[placement])
    assert (hf.lm_head.weight.data_ptr() == hf.get_input_embeddings().weight.data_ptr()) == tied  # transformers'
    with pytest.warns(UserWarning, match="left out"):
        model, params = jodpo.load_model(str(tmp_path / "mm"))
    assert model.tie_embeddings == tied
    references.check_language_model_of_multimodal(hf, model, params, tmp_path / "text", BUILDERS[family][1], 1e-4)
    exported = json.loads((tmp_path / "text" / "config.json").read_text())
    assert exported["tie_word_embeddings"] == tied


def test_a_tied_multimodal_qwen3_5_trains_and_exports(checkpoints, tmp_path):
    """The flag True at the top level and False in text_config, as transformers saves a tied
    Qwen3_5ForConditionalGeneration (the small Qwen3.5 models ship tied): it read as untied and stopped with
    ``missing tensors ['lm_head.weight']``; now it trains 3 steps and exports a text model that transformers reads
    back tied, to the same logits (scripts/export_hf.py's own check)."""
    multimodal("qwen3_5", checkpoints, tmp_path / "mm", True, False)
    out = tmp_path / "run"
    fields = dict(model_name_or_path=tmp_path / "mm", reward_model_path=checkpoints["qwen3_5"]["reward"],
                  dataset_name=hf_fixtures.prompt_dataset(tmp_path / "data"), output_dir=out, max_steps=3,
                  per_device_train_batch_size=2, max_new_tokens=4, max_length=96, max_prompt_length=64,
                  bf16=False, logging_steps=1, report_to="none")
    with pytest.warns(UserWarning, match="left out"):
        assert train.main([f"--config.{k}={v}" for k, v in fields.items()]) == 0
    exported, checks = export_hf.export(str(out), str(tmp_path / "hf"))
    assert "transformers" in checks[1]
    assert AutoModelForCausalLM.from_pretrained(exported).config.tie_word_embeddings


def test_a_vision_language_processor_as_processing_class(checkpoints, tmp_path):
    """TRL's test_online_dpo_vlm_trainer on a multimodal Qwen3.5 with a processor as processing_class (a stand-in
    LlavaProcessor around the checkpoint's tokenizer; TRL's tests use Idefics2's and Llava's, families jodpo does not
    have): it failed with "'LlavaProcessor' object has no attribute 'pad_token'"; now the processor's tokenizer reads
    the prompts. TRL's rows carry images, which jodpo does not pass to the language model it trains: refused in one
    line naming the column; the same prompts as text train (2 steps, as TRL's)."""
    import numpy as np
    from datasets import Dataset, features
    from PIL import Image
    from transformers import AutoModelForSequenceClassification, LlavaProcessor, Qwen3_5ForConditionalGeneration
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    from jodpo.errors import DataError

    multimodal("qwen3_5", checkpoints, tmp_path / "mm", True, False)
    dataset_dict = {
        "prompt": [
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}]}],
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What do you see?"}]}],
        ],
        "images": [
            [Image.fromarray(np.random.randint(0, 255, (64, 64, 3), dtype=np.uint8))],
            [Image.fromarray(np.random.randint(0, 255, (64, 64, 3), dtype=np.uint8))],
        ],
    }
    dataset = Dataset.from_dict(dataset_dict).cast_column("images", features.Sequence(features.Image()))
    model = Qwen3_5ForConditionalGeneration.from_pretrained(tmp_path / "mm", dtype=torch.float32)
    reward_id = str(checkpoints["llama"]["reward"])
    reward_model = AutoModelForSequenceClassification.from_pretrained(reward_id, num_labels=1)
    processor = LlavaProcessor(image_processor=CLIPImageProcessorPil(),
                               tokenizer=AutoTokenizer.from_pretrained(tmp_path / "mm"))
    reward_tokenizer = AutoTokenizer.from_pretrained(reward_id)
    reward_tokenizer.pad_token = reward_tokenizer.eos_token

    def trainer(rows, out):
        training_args = jodpo.OnlineDPOConfig(output_dir=str(tmp_path / out), per_device_train_batch_size=1,
                                              max_steps=2, learning_rate=0.01, report_to="none", max_new_tokens=4,
                                              max_length=96, max_prompt_length=64, bf16=False)
        return jodpo.OnlineDPOTrainer(model=model, reward_funcs=reward_model, args=training_args,
                                      processing_class=processor, train_dataset=rows, eval_dataset=rows,
                                      reward_processing_classes=reward_tokenizer)

    with pytest.raises(DataError, match="the dataset has an 'images' column: jodpo trains a vision-language "
                                        "checkpoint's language model on text prompts"):
        trainer(dataset, "images").train()
    text = Dataset.from_dict({"prompt": [[{"role": "user", "content": m[0]["content"][1]["text"]}]
                                         for m in dataset_dict["prompt"]]})
    with pytest.raises(DataError, match="'prompt' column holds messages with image parts"):
        trainer(Dataset.from_dict({"prompt": dataset_dict["prompt"]}), "parts").train()
    trained = trainer(text, "text")
    with pytest.warns(UserWarning, match="left out"):
        trained.train()
    assert trained.state.log_history[-1]["train_loss"] is not None
    assert trained.processing_class is processor

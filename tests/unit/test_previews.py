"""Request previews: the last user message out of each supported family's chat template."""

from __future__ import annotations

import pytest

from engine.services.previews import last_user_message, preview

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.mark.parametrize("template,text", [
    ("chatml", f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nFirst?<|im_end|>\n<|im_start|>assistant\n"
               "Yes.<|im_end|>\n<|im_start|>user\nWhy is the sky blue?<|im_end|>\n<|im_start|>assistant\n"),
    ("llama3", f"<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n{SYSTEM}<|eot_id|>"
               "<|start_header_id|>user<|end_header_id|>\n\nWhy is the sky blue?<|eot_id|>"
               "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    ("gemma", "<bos><start_of_turn>user\nFirst?<end_of_turn>\n<start_of_turn>model\nYes.<end_of_turn>\n"
              "<start_of_turn>user\nWhy is the sky blue?<end_of_turn>\n<start_of_turn>model\n"),
    ("mistral", "<s>[INST] First? [/INST] Yes.</s>[INST] Why is the sky blue? [/INST]"),
])
def test_the_last_user_turn_of_each_template(template, text):
    assert last_user_message(text) == "Why is the sky blue?", template
    assert preview(text, chars=7) == "Why is "


def test_a_prompt_without_a_user_turn_previews_as_it_is():
    assert last_user_message("Once upon a time") is None and preview("Once upon a time") == "Once upon a time"
    assert preview(None) is None and preview("") == ""
    unfinished = "<|im_start|>user\nA question cut short"  # no end marker: the rest of the text
    assert last_user_message(unfinished) == "A question cut short"

"""The SAE registry against sae-lens' own release table (its installed pretrained_saes.yaml; no
download): every registry release maps each layer to an SAE id the release has, that SAE reads
that layer's residual stream (resid_pre of the next block, or resid_post of the layer), and its
Neuronpedia id is the table's. Plus the two things the registry decides beyond the table: an SAE
of another family is refused, and an SAE trained on TransformerLens' centred residual stream is
fed centred inputs on LayerNorm models only."""

from __future__ import annotations

import re

import pytest
import torch

from engine.services.sae import SAE_REGISTRY, SAEEncoder, SAEShapeError, format_for_layer, sae_layer_from_hook

RELEASES = {name: source for name, source in SAE_REGISTRY.items() if source.release}


def _hook_of(release: str, sae_id: str, folder: str) -> str:
    """The hook the release's SAE reads, from what sae-lens knows without downloading: the SAE id
    itself (res-jb, res-sm, res-wg), sae-lens' Gemma Scope cfg builder, or the folder's name."""
    if sae_id.startswith("blocks."):
        return sae_id
    if release == "gemma-scope-2b-pt-res-canonical":
        from sae_lens.loading.pretrained_sae_loaders import get_gemma_2_config_from_hf
        from sae_lens.loading.pretrained_saes_directory import get_repo_id_and_folder_name

        return get_gemma_2_config_from_hf(*get_repo_id_and_folder_name(release, sae_id), "cpu")["hook_name"]
    if release == "gemma-scope-2-1b-pt-res":  # sae-lens: "resid_post" in the folder → blocks.L.hook_resid_post
        layer = re.fullmatch(r"resid_post/layer_(\d+)_.*", folder)
        return f"blocks.{layer.group(1)}.hook_resid_post" if layer else folder
    if release == "llama_scope_lxr_8x":  # Llama Scope's LXR folders hold hook_point_in blocks.L.hook_resid_post
        layer = re.search(r"-L(\d+)R-", folder)
        return f"blocks.{layer.group(1)}.hook_resid_post" if layer else folder
    raise AssertionError(f"no way to read {release}'s hook offline")


# which of a release's SAEs the registry picks when a release has several per layer
CHOSEN = {"gemma-scope-2-1b-pt-res": lambda sae_id: sae_id.endswith("_width_16k_l0_medium")}
# the layer count of each release's model: an SAE of the last layer is refused (a generation step
# reads the last layer after the final norm), so the registry need not reach it
MODEL_LAYERS = {"llama_scope_lxr_8x": 32, "gemma-scope-2b-pt-res-canonical": 26, "gemma-scope-2-1b-pt-res": 26,
                "gpt2-small-res-jb": 12, "pythia-70m-deduped-res-sm": 6, "mistral-7b-res-wg": 32}


@pytest.mark.parametrize("name", sorted(RELEASES))
def test_each_release_maps_every_usable_layer_to_its_sae_and_neuronpedia_id(name):
    from sae_lens.loading.pretrained_saes_directory import get_pretrained_saes_directory

    source = RELEASES[name]
    table = get_pretrained_saes_directory()[source.release]
    chosen = CHOSEN.get(name, lambda sae_id: True)
    usable = {}  # layer → the release's SAE of that layer's residual stream
    for sae_id, folder in table.saes_map.items():
        hook = _hook_of(source.release, sae_id, folder)
        if chosen(sae_id) and re.fullmatch(r"blocks\.\d+\.hook_resid_(post|pre)", hook) \
                and hook != "blocks.0.hook_resid_pre":  # the embeddings: no block's output
            layer = sae_layer_from_hook(hook)
            if layer < MODEL_LAYERS[name] - 1:
                usable.setdefault(layer, sae_id)
    assert usable, f"{name}: the release has no residual-stream SAE raylens can use"
    for layer, expected in usable.items():
        assert source.sae_id(layer) == expected, f"{name} layer {layer}"
        published = (table.neuronpedia_id or {}).get(expected)
        if published and source.neuronpedia_template:
            assert format_for_layer(source.neuronpedia_template, layer) == published, (name, layer)


def test_gpt2_res_jb_layer_8_is_the_tutorials_blocks_8_resid_pre():
    source = SAE_REGISTRY["gpt2-small-res-jb"]
    assert source.sae_id(7) == "blocks.8.hook_resid_pre"  # the residual stream after layer 7
    assert format_for_layer(source.neuronpedia_template, 7) == "gpt2-small/8-res-jb"
    assert SAE_REGISTRY["pythia-70m-deduped-res-sm"].sae_id(3) == "blocks.3.hook_resid_post"
    assert SAE_REGISTRY["gemma-scope-2b-pt-res-canonical"].sae_id(12) == "layer_12/width_16k/canonical"


D_IN = 16


def _centred_sae(path):
    from sae_lens import StandardSAE, StandardSAEConfig
    from sae_lens.saes.sae import SAEMetadata

    torch.manual_seed(0)
    sae = StandardSAE(StandardSAEConfig(d_in=D_IN, d_sae=32, metadata=SAEMetadata(
        hook_name="blocks.2.hook_resid_pre", model_from_pretrained_kwargs={"center_writing_weights": True})))
    with torch.no_grad():
        for p in sae.parameters():
            p.normal_()
    sae.save_model(path)
    return str(path)


def test_a_centred_stream_sae_is_fed_centred_inputs_on_layernorm_models_only(tmp_path):
    path = _centred_sae(tmp_path / "sae")
    args = dict(layer=1, top_k=4, model_hidden_size=D_IN, model_layers=4)
    gpt2 = SAEEncoder.load(path, model_family="gpt2", **args)
    gemma = SAEEncoder.load(path, model_family="gemma2", **args)
    assert gpt2.center_input and not gemma.center_input
    x = torch.randn(6, D_IN) + 3.0  # a stream with a mean, as an uncentred model's is
    with torch.no_grad():
        centred = torch.topk(gpt2.sae.encode(x - x.mean(-1, keepdim=True)), 4)
        plain = torch.topk(gpt2.sae.encode(x), 4)
    torch.testing.assert_close(gpt2.encode_topk(x)[0], centred.values)
    torch.testing.assert_close(gemma.encode_topk(x)[0], plain.values)
    assert not torch.allclose(centred.values, plain.values), "positive control: centring changed the features"


def test_a_registry_sae_of_another_family_is_refused_before_it_downloads():
    with pytest.raises(SAEShapeError, match="must be an SAE of this model's family llama, got one trained on a gpt2"):
        SAEEncoder.load("gpt2-small-res-jb", layer=7, top_k=4, model_hidden_size=768, model_layers=12,
                        model_family="llama")


@pytest.mark.parametrize("config,family", [("gemma2-2b.yaml", "gemma2"), ("gpt2-small.yaml", "gpt2"),
                                           ("llama31-8b.yaml", "llama")])
def test_each_production_config_pairs_its_model_with_an_sae_of_that_models_layer(config, family):
    from sae_lens.loading.pretrained_saes_directory import get_pretrained_saes_directory

    from engine.config import load_config
    from tests.helpers import REPO

    cfg = load_config(REPO / "configs" / config, env={})
    source = SAE_REGISTRY[cfg.sae.sae_id]
    assert source.family == family and cfg.sae.enabled
    assert cfg.sae.layer == cfg.backend.hidden_state_layer  # events carry the layer the SAE reads
    assert source.sae_id(cfg.sae.layer) in get_pretrained_saes_directory()[source.release].saes_map

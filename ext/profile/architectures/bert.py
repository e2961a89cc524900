"""BERT pre-training models (Devlin et al., NAACL 2019) with Hugging Face's module names:
encoder + pooler + masked-LM head (transform, LayerNorm, decoder tied to the word embedding with
its own bias) + next-sentence head. Attention masking is left out: it adds no FLOPs."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class BertConfig:
    """Sizes of a BERT model; the defaults are BERT-Base (uncased WordPiece vocabulary)."""

    vocab_size: int = 30522
    max_positions: int = 512
    type_vocab_size: int = 2
    hidden: int = 768
    num_layers: int = 12
    num_heads: int = 12
    intermediate: int = 3072
    layer_norm_eps: float = 1e-12


class BertEmbeddings(nn.Module):
    """Word + position + token-type embeddings, LayerNorm, dropout."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden)
        self.position_embeddings = nn.Embedding(config.max_positions, config.hidden)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden)
        self.LayerNorm = nn.LayerNorm(config.hidden, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(0.1)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor) -> Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        embeddings = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        embeddings = embeddings + self.token_type_embeddings(token_type_ids)
        return self.dropout(self.LayerNorm(embeddings))


class BertSelfAttention(nn.Module):
    """Multi-head scaled dot-product attention; the score and context products run here."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.query = nn.Linear(config.hidden, config.hidden)
        self.key = nn.Linear(config.hidden, config.hidden)
        self.value = nn.Linear(config.hidden, config.hidden)
        self.dropout = nn.Dropout(0.1)

    def _heads(self, x: Tensor) -> Tensor:
        batch, seq, hidden = x.shape
        return x.view(batch, seq, self.num_heads, hidden // self.num_heads).transpose(1, 2)

    def forward(self, x: Tensor) -> Tensor:
        query, key, value = self._heads(self.query(x)), self._heads(self.key(x)), self._heads(self.value(x))
        scores = query @ key.transpose(-1, -2) / math.sqrt(query.shape[-1])
        context = self.dropout(scores.softmax(-1)) @ value
        return context.transpose(1, 2).flatten(2)


class BertResidualOutput(nn.Module):
    """Dense projection, dropout, residual add, LayerNorm (Hugging Face's BertSelfOutput/BertOutput)."""

    def __init__(self, in_features: int, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(in_features, config.hidden)
        self.LayerNorm = nn.LayerNorm(config.hidden, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(0.1)

    def forward(self, x: Tensor, residual: Tensor) -> Tensor:
        return self.LayerNorm(self.dropout(self.dense(x)) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertResidualOutput(config.hidden, config)

    def forward(self, x: Tensor) -> Tensor:
        return self.output(self.self(x), x)


class BertIntermediate(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden, config.intermediate)
        self.intermediate_act_fn = nn.GELU()

    def forward(self, x: Tensor) -> Tensor:
        return self.intermediate_act_fn(self.dense(x))


class BertLayer(nn.Module):
    """Self-attention block, then the feed-forward block, each with residual and LayerNorm."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertResidualOutput(config.intermediate, config)

    def forward(self, x: Tensor) -> Tensor:
        attended = self.attention(x)
        return self.output(self.intermediate(attended), attended)


class BertEncoder(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_layers))

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layer:
            x = layer(x)
        return x


class BertPooler(nn.Module):
    """tanh(dense(first token's hidden state)): the sentence representation for the NSP head."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden, config.hidden)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.dense(x[:, 0]))


class BertModel(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        self.pooler = BertPooler(config)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor) -> tuple[Tensor, Tensor]:
        sequence = self.encoder(self.embeddings(input_ids, token_type_ids))
        return sequence, self.pooler(sequence)


class BertPredictionHeadTransform(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden, config.hidden)
        self.transform_act_fn = nn.GELU()
        self.LayerNorm = nn.LayerNorm(config.hidden, eps=config.layer_norm_eps)

    def forward(self, x: Tensor) -> Tensor:
        return self.LayerNorm(self.transform_act_fn(self.dense(x)))


class BertLMPredictionHead(nn.Module):
    """Masked-LM head: transform, then a decoder onto the vocabulary (weight tied by the owner)."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.transform = BertPredictionHeadTransform(config)
        self.decoder = nn.Linear(config.hidden, config.vocab_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.decoder(self.transform(x))


class BertPreTrainingHeads(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.predictions = BertLMPredictionHead(config)
        self.seq_relationship = nn.Linear(config.hidden, 2)

    def forward(self, sequence: Tensor, pooled: Tensor) -> tuple[Tensor, Tensor]:
        return self.predictions(sequence), self.seq_relationship(pooled)


class BertForPreTraining(nn.Module):
    """BERT with both pre-training heads; the MLM decoder shares the word-embedding matrix."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.bert = BertModel(config)
        self.cls = BertPreTrainingHeads(config)
        self.cls.predictions.decoder.weight = self.bert.embeddings.word_embeddings.weight

    def forward(self, input_ids: Tensor, token_type_ids: Tensor) -> tuple[Tensor, Tensor]:
        return self.cls(*self.bert(input_ids, token_type_ids))


BERT_BASE = BertConfig()
BERT_LARGE = BertConfig(hidden=1024, num_layers=24, num_heads=16, intermediate=4096)


def bert_base() -> BertForPreTraining:
    return BertForPreTraining(BERT_BASE)


def bert_large() -> BertForPreTraining:
    return BertForPreTraining(BERT_LARGE)

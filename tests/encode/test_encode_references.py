"""The encode concern, every registered reference with media (``references.REFERENCES``): each medium encoded
as ``loongforge encode``'s worker encodes it (``encode.worker``: the job's encoder call on a batch of media,
features split per medium; here each medium its own batch, the smallest the job makes), then given as stored
features (``data.vision_embeddings``) to the same model built without its encoder, gives the logits of the
model that encodes the pixels itself, on every media layout the reference has. The command's own run (files,
shards, resume, ranks) is tests/encode/test_encode.py's, on one family: the code it runs around the encoder
names no family."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Optional

import pytest
import torch

from loongforge.config.schema import ParallelConfig
from loongforge.encode import worker
from loongforge.models.media import MediaBatch, MediaSet
from tests.models.helpers import destroy_megatron, free_port, init_megatron
from tests.models.references import REFERENCES

MEDIA_REFERENCES = [name for name, reference in REFERENCES.items() if reference.has_media]


@pytest.fixture(scope="module")
def world():
    init_megatron(rank=0, world_size=1, port=free_port())
    yield
    destroy_megatron()


def _stored(encoder, media: Optional[MediaSet], modality: str, model_cfg) -> Optional[MediaSet]:
    """``media`` with its rows replaced by the features encode stores for them, medium by medium."""
    if media is None:
        return None
    decoded = [(SimpleNamespace(grid=item.grid, size=item.size or (0, 0), patches=item.rows.shape[0],
                                facts={name: value.tolist() for name, value in item.facts.items()}),
                item.rows.numpy())
               for item in media.items(modality)]
    features = [feature for batch in worker._batches(decoded, batch_patches=1)
                for feature in worker._encode(encoder, batch, torch.device("cpu"), model_cfg)]
    assert len(features) == len(media)
    return replace(media, rows=None, features=torch.cat(features))  # [sum tokens, width]


@pytest.mark.parametrize("name", MEDIA_REFERENCES)
def test_stored_features_give_the_logits_of_the_encoding_model(world, name):
    reference = REFERENCES[name]
    model_cfg, hf_model, model = reference.pair()
    without_encoder = reference.build(model_cfg, ParallelConfig(), with_encoder=False).eval()
    missing, _ = without_encoder.load_state_dict(model.state_dict(), strict=False)
    assert not missing, missing[:3]
    encoder = model._encoder  # the encoder module the training model runs (the job builds the same part)
    worst = 0.0
    for layout in [name for name in reference.layouts if name != "text"]:
        case = reference.sample(model_cfg, hf_model, **reference.layouts[layout])
        media = case.ours["media"]
        stored = MediaBatch(images=_stored(encoder, media.images, "image", model_cfg),
                            videos=_stored(encoder, media.videos, "video", model_cfg))
        with torch.no_grad():
            online = model(**case.ours)  # [1, s, V]
            offline = without_encoder(**{**case.ours, "media": stored})
        worst = max(worst, reference.difference(offline, online))
    print(f"\n{name}: stored features vs the encoding model, worst logit difference {worst:.1e}"
          f"{' of the largest' * reference.relative} over {len(reference.layouts) - 1} media layouts")
    assert worst <= reference.tolerance

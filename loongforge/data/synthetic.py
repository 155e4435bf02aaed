"""A deterministic, learnable visual QA task; no download.

Each image (56..224 px per side, varied aspect ratio) shows 1-4 coloured circles, squares or
triangles, one per quadrant, on a plain background. Questions ask for a shape's colour, a count,
a position, a description, or compare two images; answers are a fixed function of the scene, so a
small model's loss falls as it learns to read the pixels. About 10% of samples are text-only
arithmetic, so text-only rows also occur. Sample ``i`` depends only on (seed, i).

For a text-only model (``text_only``) the scene is told in words instead of drawn, and the same
questions are asked about the story (again with about 10% arithmetic): the answers stay a fixed
function of the input, so the loss still falls as the model learns to read it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from PIL import Image, ImageDraw

from loongforge.data.samples import ConversationSample
from loongforge.data.template import Turn

COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 200, 30),
    "purple": (140, 60, 180),
    "orange": (245, 130, 30),
}
BACKGROUNDS = {"white": (255, 255, 255), "grey": (190, 190, 190), "black": (20, 20, 20)}
SHAPES = ("circle", "square", "triangle")
QUADRANTS = ("top left", "top right", "bottom left", "bottom right")
MIN_SIDE_PX, MAX_SIDE_PX = 56, 224


@dataclass(frozen=True)
class Shape:
    kind: str
    colour: str
    quadrant: int  # index into QUADRANTS


@dataclass(frozen=True)
class Scene:
    width: int
    height: int
    background: str
    shapes: tuple[Shape, ...]


def random_scene(rng: random.Random, num_shapes: int | None = None) -> Scene:
    num_shapes = num_shapes or rng.randint(1, 4)
    quadrants = sorted(rng.sample(range(4), num_shapes))
    shapes = tuple(Shape(rng.choice(SHAPES), rng.choice(list(COLOURS)), q) for q in quadrants)
    return Scene(
        width=rng.randint(MIN_SIDE_PX, MAX_SIDE_PX),
        height=rng.randint(MIN_SIDE_PX, MAX_SIDE_PX),
        background=rng.choice(list(BACKGROUNDS)),
        shapes=shapes,
    )


def render_scene(scene: Scene) -> Image.Image:
    image = Image.new("RGB", (scene.width, scene.height), BACKGROUNDS[scene.background])
    draw = ImageDraw.Draw(image)
    half_w, half_h = scene.width / 2, scene.height / 2
    for shape in scene.shapes:
        row, col = divmod(shape.quadrant, 2)
        # A square box centred in the quadrant, 70% of its shorter side.
        side = 0.7 * min(half_w, half_h)
        cx, cy = (col + 0.5) * half_w, (row + 0.5) * half_h
        box = (cx - side / 2, cy - side / 2, cx + side / 2, cy + side / 2)
        fill = COLOURS[shape.colour]
        if shape.kind == "circle":
            draw.ellipse(box, fill=fill)
        elif shape.kind == "square":
            draw.rectangle(box, fill=fill)
        else:
            draw.polygon([(cx, box[1]), (box[2], box[3]), (box[0], box[3])], fill=fill)
    return image


# ---------------------------------------------------------------- questions and answers


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def ask_count(scene: Scene, rng: random.Random) -> tuple[str, str]:
    kind = rng.choice(SHAPES)
    count = sum(shape.kind == kind for shape in scene.shapes)
    if count == 0:
        answer = f"There are no {kind}s."
    elif count == 1:
        answer = f"There is one {kind}."
    else:
        answer = f"There are {count} {kind}s."
    return f"How many {kind}s are there?", answer


def ask_colour(scene: Scene, rng: random.Random) -> tuple[str, str]:
    unique = [s for s in scene.shapes if sum(o.kind == s.kind for o in scene.shapes) == 1]
    if not unique:
        return ask_count(scene, rng)
    shape = rng.choice(unique)
    return f"What colour is the {shape.kind}?", f"The {shape.kind} is {shape.colour}."


def ask_position(scene: Scene, rng: random.Random) -> tuple[str, str]:
    shape = rng.choice(scene.shapes)
    return f"Where is the {shape.colour} {shape.kind}?", f"It is in the {QUADRANTS[shape.quadrant]} corner."


def describe(scene: Scene, rng: random.Random) -> tuple[str, str]:
    parts = [f"a {s.colour} {s.kind} in the {QUADRANTS[s.quadrant]}" for s in scene.shapes]
    listing = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    answer = (f"The image shows {_plural(len(parts), 'shape')} on a {scene.background} background: "
              f"{listing}.")
    return rng.choice(["Describe the image.", "What do you see?"]), answer


QUESTIONS = (ask_count, ask_colour, ask_position, describe)


def arithmetic_turns(rng: random.Random) -> list[Turn]:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    if rng.random() < 0.5:
        return [Turn("user", f"What is {a} plus {b}?"), Turn("assistant", f"{a} plus {b} is {a + b}.")]
    word, times = rng.choice(["red", "circle", "blue", "square"]), rng.randint(2, 6)
    return [Turn("user", f"Repeat the word {word} {times} times."), Turn("assistant", " ".join([word] * times))]


def comparison_sample(rng: random.Random) -> tuple[list[Turn], list[Image.Image]]:
    first_count, second_count = rng.sample(range(1, 5), 2)
    scenes = [random_scene(rng, first_count), random_scene(rng, second_count)]
    winner = "first" if first_count > second_count else "second"
    turns = [
        Turn("user", "<image><image>Which image has more shapes, the first or the second?"),
        Turn("assistant", f"The {winner} image has more shapes ({max(first_count, second_count)})."),
    ]
    return turns, [render_scene(scene) for scene in scenes]


def single_image_sample(rng: random.Random) -> tuple[list[Turn], list[Image.Image]]:
    scene = random_scene(rng)
    turns: list[Turn] = []
    for turn_index in range(rng.choice([1, 1, 1, 2])):
        question, answer = rng.choice(QUESTIONS)(scene, rng)
        prefix = "<image>" if turn_index == 0 else ""
        turns += [Turn("user", prefix + question), Turn("assistant", answer)]
    return turns, [render_scene(scene)]


def scene_in_words(scene: Scene) -> str:
    parts = [f"a {s.colour} {s.kind} in the {QUADRANTS[s.quadrant]}" for s in scene.shapes]
    listing = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    return f"A {scene.background} card shows {listing}."


def story_sample(rng: random.Random) -> list[Turn]:
    """A scene told in words, then one or two questions about it."""
    scene = random_scene(rng)
    turns: list[Turn] = []
    for turn_index in range(rng.choice([1, 1, 1, 2])):
        question, answer = rng.choice(QUESTIONS[:3])(scene, rng)
        prefix = scene_in_words(scene) + " " if turn_index == 0 else ""
        turns += [Turn("user", prefix + question), Turn("assistant", answer)]
    return turns


class SyntheticSamples:
    """``num_samples`` samples; ``get(i)`` renders sample i from (seed, i) alone. ``text_only``:
    samples without images, for a model without a vision tower."""

    def __init__(self, num_samples: int, seed: int, text_only: bool = False):
        if num_samples < 1:
            raise ValueError(f"data.synthetic_num_samples must be >= 1, got {num_samples}")
        self.num_samples = num_samples
        self.seed = seed
        self.text_only = text_only

    def __len__(self) -> int:
        return self.num_samples

    def get(self, index: int) -> ConversationSample:
        rng = random.Random(f"loongforge-synthetic:{self.seed}:{index}")
        draw = rng.random()
        if self.text_only:
            turns, images = (arithmetic_turns(rng) if draw < 0.1 else story_sample(rng)), []
        elif draw < 0.1:
            turns, images = arithmetic_turns(rng), []
        elif draw < 0.15:
            turns, images = comparison_sample(rng)
        else:
            turns, images = single_image_sample(rng)
        return ConversationSample(
            sample_id=f"synthetic:{index}", file="synthetic", line=index, turns=turns, images=images
        )

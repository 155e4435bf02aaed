"""The synthetic task is deterministic, varied, and its answers are read off the pixels."""

import random
import re

import numpy as np

from loongforge.data.synthetic import COLOURS, QUADRANTS, SyntheticSamples, random_scene, render_scene


def test_same_seed_same_samples_different_seed_different():
    a, b, c = SyntheticSamples(50, 7), SyntheticSamples(50, 7), SyntheticSamples(50, 8)
    for i in range(50):
        sa, sb = a.get(i), b.get(i)
        assert sa.turns == sb.turns
        assert [np.asarray(x).tobytes() for x in sa.images] == [np.asarray(x).tobytes() for x in sb.images]
    assert [a.get(i).turns for i in range(50)] != [c.get(i).turns for i in range(50)]


def test_varied_sizes_questions_and_text_only_samples():
    samples = [SyntheticSamples(400, 0).get(i) for i in range(400)]
    sizes = {im.size for s in samples for im in s.images}
    assert all(56 <= w <= 224 and 56 <= h <= 224 for w, h in sizes) and len(sizes) > 100
    assert len({round(w / h, 1) for w, h in sizes}) > 10  # aspect ratios vary
    questions = " ".join(t.text for s in samples for t in s.turns if t.role == "user")
    for phrase in ("What colour is the", "How many", "Describe the image.", "Where is the", "Which image"):
        assert phrase in questions
    text_only = [s for s in samples if not s.images]
    assert 15 < len(text_only) < 80
    answer_lengths = {len(t.text) for s in samples for t in s.turns if t.role == "assistant"}
    assert min(answer_lengths) < 20 and max(answer_lengths) > 100


def test_colour_answer_matches_pixels():
    # "The circle is red." -> the pixel at that circle's quadrant centre is red.
    rng = random.Random(3)
    for _ in range(50):
        scene = random_scene(rng)
        image = np.asarray(render_scene(scene))
        for shape in scene.shapes:
            row, col = divmod(shape.quadrant, 2)
            y = int((row + 0.5) * scene.height / 2)
            x = int((col + 0.5) * scene.width / 2)
            assert tuple(image[y, x]) == COLOURS[shape.colour], (shape, QUADRANTS[shape.quadrant])


NUMBERS = {"no": 0, "one": 1, "2": 2, "3": 3, "4": 4}


def test_count_answers_are_consistent():
    # The count names the asked kind, never exceeds the shapes drawn (quadrant centres that are not
    # background), and agrees with the same image's description when the sample has both.
    samples = SyntheticSamples(300, 1)
    asked = checked_against_description = 0
    for i in range(300):
        sample = samples.get(i)
        answers = {q.text: a.text for q, a in zip(sample.turns[::2], sample.turns[1::2])}
        for question, answer in answers.items():
            match = re.search(r"How many (\w+)s are there\?", question)
            if not match:
                continue
            asked += 1
            kind = match.group(1)
            said = re.fullmatch(rf"There (?:are|is) (no|one|\d) {kind}s?\.", answer)
            assert said, answer
            image = np.asarray(sample.images[0])
            height, width = image.shape[:2]
            centres = [image[int((q // 2 + 0.5) * height / 2), int((q % 2 + 0.5) * width / 2)] for q in range(4)]
            drawn = sum(tuple(c) != tuple(image[0, 0]) for c in centres)  # the corner is background
            assert NUMBERS[said.group(1)] <= drawn, (answer, drawn)
            description = next((a for q, a in answers.items() if q in ("Describe the image.", "What do you see?")),
                               None)
            if description is not None:
                checked_against_description += 1
                assert NUMBERS[said.group(1)] == len(re.findall(rf"\b{kind}\b", description)), (answer, description)
    assert asked > 50 and checked_against_description > 0, (asked, checked_against_description)

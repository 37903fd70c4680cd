"""Generate the bundled `shapes` image set: small PNGs of colored shapes, with questions only the image answers.

    python scripts/make_shapes_dataset.py          # writes data/shapes/{images/*.png,train.jsonl} (deterministic)

Each 112x112 image (a multiple of 28, so Qwen2-VL's resize keeps pixel coordinates) holds 1-4 non-overlapping
shapes (circle, square, triangle) in distinct colors (red, green, blue, yellow) on white. Per image, rows ask:
  count   "How many shapes are in the image?"         -> "3"
  color   "What color is the circle?"                 -> "red"   (a shape that appears once)
  box     "Give the bounding box of the red square."  -> "[12, 40, 44, 72]" (pixels, x2/y2 exclusive)
Rows: {"image": "images/0007.png", "question": ..., "answer": ..., "kind": "count" | "color" | "box"}.
"""
import argparse
import json
import os
import random

from PIL import Image, ImageDraw

SIZE = 112
SHAPES = ("circle", "square", "triangle")
COLORS = {"red": (220, 30, 30), "green": (30, 160, 60), "blue": (40, 70, 220), "yellow": (230, 200, 20)}
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "shapes")


def place(rng: random.Random, boxes: list, side: int):
    """A free [x1, y1, x2, y2] box of this side, at least 4 px from the others, or None."""
    for _ in range(100):
        x, y = rng.randint(2, SIZE - side - 2), rng.randint(2, SIZE - side - 2)
        box = [x, y, x + side, y + side]
        if all(box[2] + 4 <= b[0] or b[2] + 4 <= box[0] or box[3] + 4 <= b[1] or b[3] + 4 <= box[1] for b in boxes):
            return box
    return None


def draw_image(rng: random.Random):
    """(PIL image, [(shape, color, box)]) with 1-4 shapes, colors all different."""
    count = rng.randint(1, 4)
    colors = rng.sample(list(COLORS), count)
    image = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
    pen = ImageDraw.Draw(image)
    items, boxes = [], []
    for color in colors:
        box = place(rng, boxes, rng.randint(22, 36))
        if box is None:
            continue
        shape = rng.choice(SHAPES)
        x1, y1, x2, y2 = box
        fill = COLORS[color]
        if shape == "circle":
            pen.ellipse([x1, y1, x2 - 1, y2 - 1], fill=fill)
        elif shape == "square":
            pen.rectangle([x1, y1, x2 - 1, y2 - 1], fill=fill)
        else:
            pen.polygon([(x1, y2 - 1), (x2 - 1, y2 - 1), ((x1 + x2 - 1) / 2, y1)], fill=fill)
        boxes.append(box)
        items.append((shape, color, box))
    return image, items


def make_rows(count: int, seed: int, out: str) -> list[dict]:
    """Draw `count` images into out/images and return their question rows (same arguments, same files)."""
    rng = random.Random(seed)
    os.makedirs(os.path.join(out, "images"), exist_ok=True)
    rows = []
    for i in range(count):
        image, items = draw_image(rng)
        name = f"images/{i:04d}.png"
        image.save(os.path.join(out, name), optimize=True)
        rows.append({"image": name, "question": "How many shapes are in the image?", "answer": str(len(items)),
                     "kind": "count"})
        shapes = [s for s, _, _ in items]
        unique = [item for item in items if shapes.count(item[0]) == 1]
        if unique:
            shape, color, _ = rng.choice(unique)
            rows.append({"image": name, "question": f"What color is the {shape}? Answer with one word.",
                         "answer": color, "kind": "color"})
        shape, color, box = rng.choice(items)
        rows.append({"image": name, "question": f"Give the bounding box of the {color} {shape} as [x1, y1, x2, y2] "
                     f"in pixels.", "answer": json.dumps(box), "kind": "box"})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=300, help="images to draw")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", default=DEFAULT_OUT)
    args = parser.parse_args()
    rows = make_rows(args.count, args.seed, args.out)
    with open(os.path.join(args.out, "train.jsonl"), "w", encoding="utf-8", newline="\n") as fh:
        fh.write("".join(json.dumps(row) + "\n" for row in rows if row["kind"] != "box"))
    with open(os.path.join(args.out, "boxes.jsonl"), "w", encoding="utf-8", newline="\n") as fh:
        fh.write("".join(json.dumps(row) + "\n" for row in rows if row["kind"] == "box"))
    print(f"wrote {args.count} images and {len(rows)} questions to {os.path.normpath(args.out)}")


if __name__ == "__main__":
    main()

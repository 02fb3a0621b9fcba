"""A labelled image folder: which files, which class index each (``deploy.py eval --data DIR``).

Two layouts, as people keep validation sets:

- **one folder per class** (torchvision's ``ImageFolder``): ``DIR/<class>/<image>``.  A folder's
  class index comes from, in this order: ``--classes FILE`` (one class name per line in index
  order, or ``name index`` per line, or a JSON object ``{name: index}``); an ImageNet WordNet id
  (``n01440764``: its place among ImageNet-1k's 1000 sorted ids, ``imagenet_synsets.txt``); a
  name that is an integer (``7``); the library's own category names (torchvision's ImageNet
  names, ``tench``; case and ``_`` / space ignored).
- **one flat folder plus a labels file** (``--labels FILE``): a UTF-8 text file of ``<file>
  <label>`` or ``<file>,<label>`` per line, the label a class index, a WordNet id or a category
  name, the file relative to ``DIR``; blank lines are ignored.  A first line is a header, and
  skipped, only when it is unmistakably one (:func:`_is_header`: both its fields are column
  names such as ``file,label``); any other line that does not read is an error naming its line
  (the file's own line number), as is a file listed twice.

Images are the files of ``data.IMAGE_SUFFIXES`` (what calibration reads too); one that cannot be
read is named in the result and left out (:func:`read_batch`), not fatal: the count used is
always reported.  Both ``eval --data`` and ``compare --data`` read folders through this module.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from importlib import resources

import numpy as np

from .data import IMAGE_SUFFIXES, load_image
from .errors import InputError

SUFFIXES = IMAGE_SUFFIXES   # one list for every folder of images (data.py)
LABELS_FORMAT = "'<file> <label>' or '<file>,<label>' per line"
# A first line whose two fields are one of each is a header (any case; ' ', '_', '-' alike).
HEADER_FILE_WORDS = frozenset({"file", "filename", "file name", "files", "image", "images", "image name",
                               "image file", "image path", "img", "path", "filepath", "file path", "name", "id",
                               "image id"})
HEADER_LABEL_WORDS = frozenset({"label", "labels", "class", "classes", "class id", "class index", "class name",
                                "category", "category id", "target", "y", "synset", "wnid"})
_WNID = re.compile(r"^n\d{8}$")


def imagenet_synsets() -> list[str]:
    """ImageNet-1k's WordNet ids in class-index order (sorted: torchvision's and timm's order)."""
    return resources.files("tvm_qconv").joinpath("imagenet_synsets.txt").read_text().split()


@dataclass
class LabelledImages:
    """``paths[i]`` is of class ``labels[i]``; ``layout`` says how the labels were read."""

    paths: list[str]
    labels: np.ndarray
    layout: str
    skipped: list[tuple[str, str]] = field(default_factory=list)   # (file, why), filled while reading


def _key(name: str) -> str:
    return re.sub(r"[\s_]+", " ", name.strip().lower())


def _resolver(categories: list[str] | None, classes: dict[str, int] | None):
    """``name -> class index`` (None where nothing says), by the rules of the module docstring."""
    synsets = {w: i for i, w in enumerate(imagenet_synsets())}
    by_category = {_key(c): i for i, c in enumerate(categories or [])}

    def index(name: str) -> int | None:
        if classes is not None:
            return classes.get(name)
        if _WNID.match(name):
            return synsets.get(name)
        if re.fullmatch(r"\d+", name):
            return int(name)
        return by_category.get(_key(name))

    return index


def read_classes_file(path: str) -> dict[str, int]:
    """``--classes FILE``: ``{class name: index}`` from a JSON object, ``name index`` lines, or
    one name per line (its line number, from 0, is its index)."""
    text = _read_text(path, "--classes", "a text file of one class name per line (in class-index order), "
                      "'name index' per line, or a JSON object {name: index}")
    if text.lstrip().startswith("{"):
        try:
            return {str(k): int(v) for k, v in json.loads(text).items()}
        except (ValueError, TypeError) as err:
            raise InputError(f"--classes {path}: not a JSON object of class name -> index ({err})") from None
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    pairs = [ln.rsplit(maxsplit=1) for ln in lines]
    if all(len(p) == 2 and p[1].isdigit() for p in pairs):
        return {name: int(i) for name, i in pairs}
    return {name: i for i, name in enumerate(lines)}


def labelled_images(data: str, labels_file: str | None = None, classes_file: str | None = None,
                    categories: list[str] | None = None, num_classes: int | None = None) -> LabelledImages:
    """The images of ``data`` and their class indices.

    Args:
        data: the folder.
        labels_file: a flat folder's labels (module docstring); None: one folder per class.
        classes_file: the class folders' indices (:func:`read_classes_file`).
        categories: the library's category names (its json record), for folders named by them.
        num_classes: the library's outputs: a label at or beyond it is refused.

    Raises:
        InputError: no such folder, no images, a class or file the labels do not resolve (named,
            with what to give).
    """
    if not os.path.isdir(data):
        raise InputError(f"--data {data}: " + ("a file, not a folder: give the folder of the labelled images"
                                               if os.path.exists(data) else "no such folder"))
    classes = read_classes_file(classes_file) if classes_file else None
    index = _resolver(categories, classes)
    if labels_file is not None:
        paths, labels, layout = _flat(data, labels_file, index)
    else:
        paths, labels, layout = _per_class(data, index, classes_file)
    if not paths:
        raise InputError(f"--data {data}: no images found ({', '.join(SUFFIXES)})")
    labels = np.asarray(labels, np.int64)
    if num_classes is not None and int(labels.max()) >= num_classes:
        bad = paths[int(np.argmax(labels))]
        raise InputError(f"--data {data}: {bad} is labelled class {int(labels.max())}, the library has {num_classes} "
                         "outputs: labels are class indices from 0")
    return LabelledImages(paths, labels, layout)


def _images_in(folder: str) -> list[str]:
    return sorted(os.path.join(folder, f) for f in os.listdir(folder)
                  if f.lower().endswith(SUFFIXES) and os.path.isfile(os.path.join(folder, f)))


def _per_class(data: str, index, classes_file: str | None):
    folders = sorted(d for d in os.listdir(data) if os.path.isdir(os.path.join(data, d)))
    if not folders:
        raise InputError(f"--data {data} has no class folders: give one folder per class (ImageFolder), or a flat "
                         "folder with --labels FILE")
    unknown = [d for d in folders if index(d) is None]
    if unknown:
        how = (f"add them to --classes {classes_file}" if classes_file else
               "give --classes FILE (one class name per line, in class-index order), or name the folders by class "
               "index, ImageNet WordNet id (n01440764) or the model's category names")
        raise InputError(f"--data {data}: no class index for folder(s) {', '.join(unknown[:6])}"
                         f"{' ...' if len(unknown) > 6 else ''}: {how}")
    paths, labels = [], []
    for d in folders:
        files = _images_in(os.path.join(data, d))
        paths += files
        labels += [index(d)] * len(files)
    how = "--classes file" if classes_file else "folder names"
    return paths, labels, f"{len(folders)} class folders (indices from the {how})"


def _read_text(path: str, flag: str, expected: str) -> str:
    """The UTF-8 text of ``path`` (a BOM dropped); a binary file (a NUL byte: images, archives,
    UTF-16) or other encoding is refused in one line that says what ``flag`` takes."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as err:
        raise InputError(f"{flag} {path}: cannot read it ({err.strerror})") from None
    try:
        if b"\0" in raw:
            raise UnicodeDecodeError("utf-8", raw, raw.index(b"\0"), raw.index(b"\0") + 1, "a NUL byte")
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        what = "labels" if flag == "--labels" else "classes"
        raise InputError(f"{flag} {path} is not a text {what} file (byte {err.start} is not UTF-8 text): give "
                         f"{expected}") from None


def _fields(line: str) -> list[str]:
    return [p.strip() for p in (line.split(",") if "," in line else line.rsplit(maxsplit=1))]


def _is_header(fields: list[str], data: str, index) -> bool:
    """Whether a first line is a header: its fields are a file column's name and a label
    column's (``file,label``, ``image class``, ...), its label is no class and its file is not in
    ``data``.  Anything less certain is read as data, so a typo on line 1 is an error, not a line
    silently dropped."""
    if len(fields) != 2:
        return False
    name, label = (_key(f).replace("-", " ") for f in fields)
    return (name in HEADER_FILE_WORDS and label in HEADER_LABEL_WORDS and index(fields[1]) is None
            and not os.path.isfile(os.path.join(data, fields[0])))


def _flat(data: str, labels_file: str, index):
    text = _read_text(labels_file, "--labels", f"a text file of {LABELS_FORMAT}, the file relative to --data")
    numbered = [(n, ln.strip()) for n, ln in enumerate(text.splitlines(), start=1) if ln.strip()]
    first = numbered[0][0] if numbered else 0
    if numbered and _is_header(_fields(numbered[0][1]), data, index):
        numbered = numbered[1:]
    where = f"--labels {labels_file}, line"
    paths, labels, missing = [], [], []
    line_of: dict[str, int] = {}    # normalized path -> the line that listed it
    for n, line in numbered:
        parts = _fields(line)
        if len(parts) != 2 or not all(parts):
            raise InputError(f"{where} {n}: {line[:120]!r} is not '<file> <label>' (the format: {LABELS_FORMAT})")
        name, label = parts
        cls = index(label)
        if cls is None:
            header = " (a header line names its columns, e.g. 'file,label')" if n == first else ""
            raise InputError(f"{where} {n}: label {label!r} is not a class index, an ImageNet WordNet id or one of "
                             f"the model's category names{header}")
        path = os.path.normpath(os.path.join(data, name))
        if path in line_of:
            raise InputError(f"--labels {labels_file} lists {name} twice, on lines {line_of[path]} and {n}: "
                             "give each image one line")
        line_of[path] = n
        if not os.path.isfile(path):
            missing.append(f"{name} (line {n})")
            continue
        paths.append(path)
        labels.append(cls)
    if missing:
        raise InputError(f"--labels {labels_file} names {len(missing)} file(s) not in {data}: "
                         f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
    return paths, labels, f"a flat folder labelled by {os.path.basename(labels_file)}"


def read_batch(images: LabelledImages, start: int, count: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Images ``start .. start + count`` preprocessed (``data.load_image``) and their labels; an
    unreadable one is recorded in ``images.skipped`` and left out."""
    xs, ys = [], []
    for path, label in zip(images.paths[start:start + count], images.labels[start:start + count]):
        try:
            xs.append(load_image(path, size))
            ys.append(label)
        except InputError as err:
            images.skipped.append((path, str(err)))
    if not xs:
        return np.zeros((0, 3, size, size), np.float32), np.zeros((0,), np.int64)
    return np.stack(xs), np.asarray(ys, np.int64)

"""The Ultralytics keys yoloaccum does not take, each with the reason, so a recipe written for `yolo train` loads.

Three kinds: keys that describe a run rather than a recipe (an Ultralytics run's args.yaml holds them), keys that
earlier Ultralytics 8.x releases had and 8.4 retired, and 8.4 keys for other tasks, predict, export or features
yoloaccum lacks. A recipe's are dropped and listed; given on the command line they are refused with the reason.
tests/test_config.py checks that every key of the installed Ultralytics' default.yaml is ours or is here.
"""

from __future__ import annotations

# What an Ultralytics run writes into its args.yaml about itself: not part of the recipe.
RUN_KEYS = {
    "task": "the run's task (yoloaccum trains detection)",
    "mode": "the run's mode",
    "save_dir": "the run's folder (yoloaccum makes its own under project/name)",
    "cfg": "the recipe file itself",
}

# Keys of earlier Ultralytics 8.x default.yaml files that 8.4 no longer has.
RETIRED = {
    "half": "export and predict precision, replaced by quantize in Ultralytics 8.4",
    "int8": "export precision, replaced by quantize in Ultralytics 8.4",
    "keras": "a TensorFlow export option, retired",
    "label_smoothing": "retired by Ultralytics in 8.1",
    "fl_gamma": "focal loss gamma, retired by Ultralytics",
    "v5loader": "the YOLOv5 data loader, retired by Ultralytics",
    "save_hybrid": "retired by Ultralytics",
    "boxes": "a display option, now show_boxes",
    "line_thickness": "a display option, now line_width",
    "hide_labels": "a display option, now show_labels",
    "hide_conf": "a display option, now show_conf",
    "crop_fraction": "a classification option, retired",
    "bgr_img": "retired by Ultralytics",
}

_PREDICT = (
    "a predict option; predict with ultralytics.YOLO(best.pt).predict (yoloaccum predict takes conf, iou, max_det)"
)
_EXPORT = "an export option; export best.pt with ultralytics.YOLO(best.pt).export"
_OTHER_TASK = "for {} models only; yoloaccum trains detection"

# Ultralytics 8.4 keys yoloaccum does not support, and why.
UNSUPPORTED = {
    **dict.fromkeys(("overlap_mask", "mask_ratio", "copy_paste", "copy_paste_mode"), _OTHER_TASK.format("segment")),
    **dict.fromkeys(("pose", "kobj", "rle"), _OTHER_TASK.format("pose")),
    "angle": _OTHER_TASK.format("OBB"),
    **dict.fromkeys(("dlog", "dgrad", "dlam"), _OTHER_TASK.format("depth")),
    **dict.fromkeys(("dropout", "auto_augment", "erasing"), _OTHER_TASK.format("classification")),
    **dict.fromkeys(("distill_model", "dis"), "knowledge distillation is not supported"),
    "cls_pw": "class-frequency loss weights are not supported (every class weighs the same, as cls_pw=0)",
    "profile": "ONNX and TensorRT profiling is not part of training; export best.pt and profile it",
    "save_json": "COCO JSON results: validate best.pt with ultralytics.YOLO(best.pt).val(save_json=True)",
    "tracker": "a tracking option; track with ultralytics.YOLO(best.pt).track",
    **dict.fromkeys(
        (
            "vid_stride",
            "stream_buffer",
            "visualize",
            "augment",
            "agnostic_nms",
            "retina_masks",
            "embed",
            "show",
            "save_frames",
            "save_txt",
            "save_conf",
            "save_crop",
            "show_labels",
            "show_conf",
            "show_boxes",
            "line_width",
        ),
        _PREDICT,
    ),
    **dict.fromkeys(
        ("format", "optimize", "dynamic", "simplify", "opset", "workspace", "nms", "quantize", "dnn"), _EXPORT
    ),
}


def reason(key: str) -> str | None:
    """Why yoloaccum does not take an Ultralytics key, or None if it is not one of those."""
    return RUN_KEYS.get(key) or RETIRED.get(key) or UNSUPPORTED.get(key)

"""Vision-language policies (Qwen2.5-VL style): image prompts, their processed inputs, multimodal rotary positions.

- ``inputs.py``: :class:`VisionInputs`, one prompt's processed images (what rides in a rollout batch, once per group).
- ``prompts.py``: dataset rows with images -> chat messages with image parts -> prompt ids + :class:`VisionInputs`.
- ``rope.py``: the 3-axis (time, height, width) rotary positions of a sequence with images.
- ``models.py``: telling a vision-language checkpoint from a text one, loading either, the vision tower's weights.
"""

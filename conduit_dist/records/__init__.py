"""Records: the experience spec (fields, record layout, validation, packing) and the reusable
record buffers (staging, delivery outputs)."""

"""Hugging Face checkpoints read and written by slices: what ``ts.nn.from_pretrained``,
``ts.nn.from_config`` and ``save_pretrained`` do (docs/pretrained.md).

Loading, in the order it runs (load_steps.py names the steps; from_pretrained and from_config, which
call ``parallelize`` between them, are in nn/whole_model/pretrained.py): model_source.py (the class
or factory, its config and dtype), meta_build.py (the build on the meta device, recording what the
model's own init writes: init_record.py; is_meta_while_building.py), checkpoint_files.py and
safetensors_format.py (the folder's files and headers), checkpoint_keys.py (transformers' renamings
and merges of the keys), key_match.py (which tensor fills which weight), agreement.py (every rank's
verdict before the next collective), slice_reads.py and safetensors_read.py (each rank's slices,
read or mapped), materialize.py (shard-shaped tensors for the meta ones), init_replay.py and
chunked_draw.py (the model's own init, replayed into the slices).

Saving: save.py (``save_pretrained``, streamed tensor by tensor), original_format.py (the names
transformers saves under).

This file imports nothing: shardtorch.checkpoint takes save_pretrained from here while the package
is still being imported, and the loader's steps import shardtorch.nn.
"""

"""Peer servers measured beside SpecWhisper: their set-up, launch and clients (`python -m app peerbench`)."""

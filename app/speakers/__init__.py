"""Who spoke when: speaker embeddings over windows of speech, clustered into speakers, given to words.

`embedders` holds the contract (`SpeakerEmbedder`: windows of 16-kHz audio in, unit vectors out) and finds the
operator's choice; `ge2e` is the default, the GE2E speaker encoder whose weights install with the `resemblyzer`
wheel; `onnx` runs an embedder file the operator names. Those run in the worker, where torch is. `windows`,
`clustering` (with `linkage`), `voiced` and `turns` are numpy only: the serving layer plans windows, clusters their
embeddings into speakers, trims the speech regions to their voice and gives each word its speaker.
"""

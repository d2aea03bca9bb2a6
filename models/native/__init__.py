"""attnserve's CPU platform, the bottom of models/: what this CPU can run (`cpu_features`), the C++
libraries built for it (`toolchain` compiles, `libraries` loads), and the path an engine takes on it
(`cpu_path`). It imports nothing else from attnserve, and nothing here compiles at import: the first
`libraries.load` does. Kept free of torch at import, so `cpu_features` can cap torch's ISA first.
"""

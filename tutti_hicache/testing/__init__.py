"""Test support shipped with the package, kept out of the product modules: the SGLang CPU harness
(`sglang`), its torchvision import stub (`torchvision_stub`) and page contents derived from keys
(`pagedata`). Used by the tests, the demo and `tutti-hicache bench store`; nothing in the storage or
linker path imports it."""

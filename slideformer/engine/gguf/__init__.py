"""GGUF in and out: import a GGUF file as a Hugging Face folder, export a folder as GGUF.

The file format is read and written by the ``gguf`` package (maintained with llama.cpp); this
package maps between llama.cpp's conventions (tensor names, the Q/K row order of Llama
attention, tokenizer metadata, chat template) and the Hugging Face folders the engine trains.
"""

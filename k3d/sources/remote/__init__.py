"""sources/remote"""

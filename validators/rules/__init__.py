"""validators/rules"""

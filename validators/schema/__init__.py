"""validators/schema"""

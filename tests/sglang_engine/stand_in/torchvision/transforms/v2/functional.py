"""``torchvision.transforms.v2.functional`` of the stand-in: imported as a module, no name of it is used."""

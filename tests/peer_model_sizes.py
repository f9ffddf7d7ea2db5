"""For the peer-model drivers (run inside the peers' venv): openpi's and LeRobot's pi05 build PaliGemma-3B's fixed
sizes (vocabulary, vision tower, projector width); these stand-ins build their own transformers classes with the
sizes of the model under test instead. Nothing else of the peers is replaced."""


def sized_classes(paligemma_class, expert_class, sizes: dict):
    """(PaliGemma factory, expert factory) taking the peer's config and building its class at `sizes`."""
    vocab, vision, vlm = sizes["vocab_size"], sizes["vision"], sizes["vlm"]

    def sized_paligemma(config):
        config.text_config.vocab_size = config._vocab_size = vocab  # noqa: SLF001
        config.image_token_index = vocab - 1
        for key, value in vision.items():
            setattr(config.vision_config, key, value)
        config.vision_config.projection_dim = vlm["width"]
        return paligemma_class(config=config)

    def sized_expert(config):
        config.vocab_size = vocab
        return expert_class(config=config)

    return sized_paligemma, sized_expert

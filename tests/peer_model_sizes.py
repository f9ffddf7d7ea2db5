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


def size_lerobot_pi05(modeling_pi05, sizes: dict) -> None:
    """Build LeRobot's pi05 (`lerobot.policies.pi05.modeling_pi05`) at `sizes`: its Gemma configs and its two
    transformers classes, before a policy is made."""

    def sized_gemma_config(variant: str):
        s = sizes["gemma"][variant]
        return modeling_pi05.GemmaConfig(width=s["width"], depth=s["depth"], mlp_dim=s["mlp_dim"], num_heads=s["num_heads"],
                                         num_kv_heads=s["num_kv_heads"], head_dim=s["head_dim"])

    sized_paligemma, sized_expert = sized_classes(modeling_pi05.PaliGemmaForConditionalGeneration,
                                                 modeling_pi05.GemmaForCausalLM, sizes)
    modeling_pi05.get_gemma_config = sized_gemma_config
    modeling_pi05.PaliGemmaForConditionalGeneration = sized_paligemma
    modeling_pi05.GemmaForCausalLM = sized_expert

"""What generation_service and grammar_service both speak, beneath both (like step_channel/).

    spec.py     GrammarSpec and ReasoningSpan: the constraint as the user gave it
    report.py   UnenforcedKeyword, CompileResult, GuaranteeReport: what a compile tells the caller
    errors.py   the errors a compile ends in, each naming its gRPC status
    client.py   GrammarControlClient: the control RPCs (compile, open/close channel, health)

Neither service imports the other: both import this package. Only client.py imports grpc.
"""

// Example Go client of structgen.v1.GenerationService.
//
//	structgen-go [-server localhost:50051] [-json-schema FILE | -regex RE | -choice A,B,...]
//	             [-compact] [-max-tokens N] PROMPT
//
// Streams the generated text to stdout and the final message (finish reason, usage,
// validation) to stderr. A failed call prints "error: <STATUS>: <message>" and exits 1.
// Build with ./build.sh (stubs generated from protos/ with Debian's protoc-gen-go and
// protoc-gen-go-grpc, GOPATH mode, no network).
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/status"

	pb "structgen/structgenv1"
)

func buildRequest(prompt, schemaFile, regex, choices string, compact bool, maxTokens uint) (*pb.GenerateRequest, error) {
	request := &pb.GenerateRequest{
		Input: &pb.GenerateRequest_Prompt{Prompt: prompt},
		Stop:  &pb.StopConditions{MaxTokens: uint32(maxTokens)},
	}
	switch {
	case schemaFile != "":
		schema, err := os.ReadFile(schemaFile)
		if err != nil {
			return nil, err
		}
		request.Constraint = &pb.GenerateRequest_JsonSchema{JsonSchema: string(schema)}
	case regex != "":
		request.Constraint = &pb.GenerateRequest_Regex{Regex: regex}
	case choices != "":
		request.Constraint = &pb.GenerateRequest_Choice{Choice: &pb.Choice{Choices: strings.Split(choices, ",")}}
	}
	if compact {
		request.ConstraintOptions = &pb.ConstraintOptions{Compact: true}
	}
	return request, nil
}

// statusName turns a codes.Code name ("InvalidArgument") into the proto name ("INVALID_ARGUMENT").
func statusName(camel string) string {
	var name strings.Builder
	for i, r := range camel {
		if i > 0 && r >= 'A' && r <= 'Z' {
			name.WriteByte('_')
		}
		name.WriteRune(r)
	}
	return strings.ToUpper(name.String())
}

func fail(err error) {
	if s, ok := status.FromError(err); ok {
		fmt.Fprintf(os.Stderr, "error: %s: %s\n", statusName(s.Code().String()), s.Message())
	} else {
		fmt.Fprintf(os.Stderr, "error: %v\n", err)
	}
	os.Exit(1)
}

func main() {
	server := flag.String("server", "localhost:50051", "server address")
	schemaFile := flag.String("json-schema", "", "JSON Schema file")
	regex := flag.String("regex", "", "regular expression the output matches")
	choices := flag.String("choice", "", "comma-separated allowed outputs")
	compact := flag.Bool("compact", false, "JSON without free whitespace")
	maxTokens := flag.Uint("max-tokens", 0, "0 = server default")
	timeout := flag.Duration("timeout", 120*time.Second, "call deadline")
	flag.Parse()

	request, err := buildRequest(strings.Join(flag.Args(), " "), *schemaFile, *regex, *choices, *compact, *maxTokens)
	if err != nil {
		fail(err)
	}
	conn, err := grpc.Dial(*server, grpc.WithInsecure())
	if err != nil {
		fail(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	stream, err := pb.NewGenerationServiceClient(conn).Generate(ctx, request)
	if err != nil {
		fail(err)
	}
	for {
		response, err := stream.Recv()
		if err == io.EOF {
			break
		}
		if err != nil {
			fail(err)
		}
		fmt.Print(response.Text)
		if response.FinishReason != pb.FinishReason_FINISH_REASON_UNSPECIFIED {
			fmt.Fprintf(os.Stderr, "finish_reason=%s usage={%v} validation={%v}\n",
				response.FinishReason, response.Usage, response.Validation)
		}
	}
	fmt.Println()
}

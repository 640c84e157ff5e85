# frozen_string_literal: true

require_relative "compat_helper"
require "net/http"
require "json"

# LLM clients streaming a chat completion from a local OpenAI-compatible
# endpoint whose answer arrives token by token over 0.5 s (the model's side
# of docs/streaming.md's relay): ten streamed answers at once in one loop
# take about 0.5 s. RubyLLM and the official openai gem need a newer Ruby
# than 3.1; their rows are skipped where this Ruby's bundle lacks them.
class CompatLLMClientsTest < CompatTest
  ANSWER = "t0 t1 t2 t3 t4 " # llm_stream_server's five tokens
  MESSAGES = [{ role: "user", content: "hi" }].freeze

  def setup
    super
    @url = llm_stream_server
  end

  # Net::HTTP's streaming read_body, as a hand-written relay reads a model.
  def test_net_http_streaming_read_body
    uri = URI("#{@url}/chat/completions")
    answers = assert_concurrent_calls("Net::HTTP read_body (a model's event stream)") do
      events = +""
      Net::HTTP.start(uri.host, uri.port) do |http|
        request = Net::HTTP::Post.new(uri, "content-type" => "application/json")
        request.body = JSON.generate(model: "compat-model", stream: true, messages: MESSAGES)
        http.request(request) { |response| response.read_body { |chunk| events << chunk } }
      end
      tokens_of(events)
    end
    assert_equal [ANSWER] * CompatMatrix::CALLS, answers
  end

  # RubyLLM (Ruby 3.2+): Faraday and its net_http adapter underneath.
  def test_ruby_llm
    needs_gem("ruby_llm", "it needs Ruby 3.2+")
    require "ruby_llm"
    RubyLLM.configure do |config|
      config.openai_api_key = "compat"
      config.openai_api_base = @url
    end
    # The first chat of a process parses RubyLLM's model registry, 0.1-0.2 s
    # of CPU that holds the loop (the stall detector names it): at boot, not
    # in a request.
    RubyLLM.models
    answers = assert_concurrent_calls("ruby_llm (a streamed chat answer)", gem: "ruby_llm",
                                      note: "The first chat of a process loads RubyLLM's model registry, " \
                                            "0.1-0.2 s of CPU that holds the loop: call `RubyLLM.models` at boot.") do
      answer = +""
      RubyLLM.chat(model: "compat-model", provider: :openai, assume_model_exists: true)
             .ask("hi") { |chunk| answer << chunk.content.to_s }
      answer
    end
    assert_equal [ANSWER] * CompatMatrix::CALLS, answers
  end

  # The official openai gem (Ruby 3.3+): Net::HTTP underneath, connections
  # pooled per client; one client shared by every fiber, as an app holds it.
  def test_openai
    needs_gem("openai", "it needs Ruby 3.3+")
    require "openai"
    client = OpenAI::Client.new(api_key: "compat", base_url: @url)
    answers = assert_concurrent_calls("openai (a streamed chat answer)", gem: "openai") do
      answer = +""
      client.chat.completions.stream_raw(model: "compat-model", messages: MESSAGES).each do |chunk|
        answer << chunk.choices.first&.delta&.content.to_s
      end
      answer
    end
    assert_equal [ANSWER] * CompatMatrix::CALLS, answers
  end

  private

  # The tokens of an OpenAI event stream, in order.
  def tokens_of(events)
    events.scan(/^data: (.+)$/).flatten.reject { |data| data == "[DONE]" }
          .map { |data| JSON.parse(data).dig("choices", 0, "delta", "content").to_s }.join
  end

  def needs_gem(name, why)
    skip "#{name} is not in this Ruby's test bundle (#{why})" unless Gem.loaded_specs.key?(name)
  end
end

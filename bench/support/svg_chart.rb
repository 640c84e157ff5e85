# frozen_string_literal: true

module NeverBlockBench
  # Writes grouped bar charts as standalone SVG, with no dependencies: one
  # or more panels stacked vertically under a shared legend, one group of
  # bars per category (e.g. a server delay) and one bar per series (e.g. a
  # client). Missing values are drawn as text ("n/a", "failed").
  #
  #   chart = SvgChart.new(title: "Requests/s by server delay")
  #   chart.add_panel(title: "requests/s", categories: ["0 ms", "10 ms"],
  #                   series: { "threads" => [618, 470], "neverblock" => [2360, 1997] },
  #                   log: true)
  #   chart.write("bench/results/client.svg")
  class SvgChart
    PALETTE = %w[#4e79a7 #f28e2b #e15759 #76b7b2 #59a14f #b07aa1 #edc948 #9c755f].freeze
    WIDTH = 760
    PANEL_HEIGHT = 300
    MARGIN = { left: 72, right: 16, top: 34, bottom: 44 }.freeze
    FONT = "font-family=\"Helvetica, Arial, sans-serif\""

    # @param title [String] drawn at the top
    # @param subtitle [String, Array<String>, nil] smaller lines under it
    #   (machine, Ruby, versions), one per element
    def initialize(title:, subtitle: nil)
      @title = title
      @subtitle = Array(subtitle)
      @panels = []
    end

    # @param title [String] the panel's heading, with its unit
    # @param categories [Array<String>] group labels along the x axis
    # @param series [Hash{String => Array<Numeric, String, nil>}] one value per
    #   category; a String (e.g. "failed") is drawn instead of a bar, nil as "n/a"
    # @param log [Boolean] logarithmic y axis (for values spanning decades)
    # @return [self]
    def add_panel(title:, categories:, series:, log: false)
      @panels << { title: title, categories: categories, series: series, log: log }
      self
    end

    # @param path [String]
    # @return [String] path
    def write(path)
      File.write(path, to_svg)
      path
    end

    # @return [String] the SVG document
    def to_svg
      names = @panels.flat_map { |panel| panel[:series].keys }.uniq
      legend_rows = (names.size.to_f / legend_columns(names)).ceil
      header = 46 + (@subtitle.size * 16) + (legend_rows * 18)
      height = header + (@panels.size * PANEL_HEIGHT) + 8
      body = [title_svg, legend_svg(names, 36 + (@subtitle.size * 16))]
      @panels.each_with_index do |panel, i|
        body << panel_svg(panel, names, header + (i * PANEL_HEIGHT))
      end
      <<~SVG
        <svg xmlns="http://www.w3.org/2000/svg" width="#{WIDTH}" height="#{height}" viewBox="0 0 #{WIDTH} #{height}" #{FONT}>
        <rect width="100%" height="100%" fill="#ffffff"/>
        #{body.join("\n")}
        </svg>
      SVG
    end

    private

    def title_svg
      lines = [text(WIDTH / 2, 22, @title, size: 16, anchor: "middle", weight: "bold")]
      @subtitle.each_with_index do |line, i|
        lines << text(WIDTH / 2, 40 + (i * 16), line, size: 11, anchor: "middle", fill: "#555555")
      end
      lines.join("\n")
    end

    # As many columns as the longest name allows.
    def legend_columns(names)
      [(WIDTH - MARGIN[:left] - MARGIN[:right]) / legend_column_width(names), 1].max
    end

    # Pixels per legend column: swatch, gap and the longest name at ~6.6 px
    # per character of the 12 px font.
    def legend_column_width(names)
      ((names.map(&:size).max || 1) * 6.6).ceil + 32
    end

    def legend_svg(names, top)
      columns = legend_columns(names)
      names.each_with_index.map do |name, i|
        x = MARGIN[:left] + ((i % columns) * legend_column_width(names))
        y = top + ((i / columns) * 18)
        %(<rect x="#{x}" y="#{y}" width="12" height="12" fill="#{color(names, name)}"/>) +
          text(x + 17, y + 10, name, size: 12)
      end.join("\n")
    end

    def panel_svg(panel, names, top)
      plot = { left: MARGIN[:left], right: WIDTH - MARGIN[:right],
               top: top + MARGIN[:top], bottom: top + PANEL_HEIGHT - MARGIN[:bottom] }
      scale = Scale.new(panel[:series].values.flatten.grep(Numeric), log: panel[:log])
      parts = [text(plot[:left], top + 20, panel[:title] + (panel[:log] ? "; log scale" : ""), size: 13, weight: "bold")]
      parts.concat(axis_svg(scale, plot))
      parts.concat(bars_svg(panel, names, scale, plot))
      parts.join("\n")
    end

    def axis_svg(scale, plot)
      parts = scale.ticks.map do |tick|
        y = scale.y(tick, plot[:bottom], plot[:top]).round(1)
        %(<line x1="#{plot[:left]}" y1="#{y}" x2="#{plot[:right]}" y2="#{y}" stroke="#e3e3e3"/>) +
          text(plot[:left] - 6, y + 4, SvgChart.format_number(tick), size: 11, anchor: "end", fill: "#444444")
      end
      parts << %(<line x1="#{plot[:left]}" y1="#{plot[:bottom]}" x2="#{plot[:right]}" y2="#{plot[:bottom]}" stroke="#333333"/>)
      parts << %(<line x1="#{plot[:left]}" y1="#{plot[:top]}" x2="#{plot[:left]}" y2="#{plot[:bottom]}" stroke="#333333"/>)
    end

    def bars_svg(panel, names, scale, plot)
      group_width = (plot[:right] - plot[:left]).to_f / panel[:categories].size
      bar_width = (group_width * 0.8) / panel[:series].size
      parts = []
      panel[:categories].each_with_index do |category, c|
        group_left = plot[:left] + (c * group_width) + (group_width * 0.1)
        parts << text(group_left + (group_width * 0.4), plot[:bottom] + 18, category, size: 12, anchor: "middle")
        panel[:series].each_with_index do |(name, values), s|
          parts << bar_svg(values[c], group_left + (s * bar_width), bar_width, color(names, name), scale, plot)
        end
      end
      parts
    end

    def bar_svg(value, x, width, fill, scale, plot)
      center = x + (width / 2)
      unless value.is_a?(Numeric)
        return text(center, plot[:bottom] - 4, value || "n/a", size: 9, anchor: "middle", fill: "#999999")
      end

      y = scale.y(value, plot[:bottom], plot[:top])
      label = SvgChart.format_number(value)
      rect = %(<rect x="#{(x + 1).round(1)}" y="#{y.round(1)}" width="#{(width - 2).round(1)}" ) +
             %(height="#{(plot[:bottom] - y).round(1)}" fill="#{fill}"><title>#{escape(label)}</title></rect>)
      rect + value_label(label, center, y, width)
    end

    # Above the bar; turned upright when the bar is too narrow for the text.
    def value_label(label, center, y, width)
      if label.size * 5.6 <= width
        text(center, y - 3, label, size: 9, anchor: "middle", fill: "#333333")
      else
        %(<text x="#{center.round(1)}" y="#{(y - 3).round(1)}" font-size="9" fill="#333333" ) +
          %(transform="rotate(-90 #{center.round(1)} #{(y - 3).round(1)})" dominant-baseline="middle">#{escape(label)}</text>)
      end
    end

    def color(names, name)
      PALETTE[names.index(name) % PALETTE.size]
    end

    def text(x, y, content, size:, anchor: "start", weight: "normal", fill: "#222222")
      %(<text x="#{x.round(1)}" y="#{y.round(1)}" font-size="#{size}" text-anchor="#{anchor}" ) +
        %(font-weight="#{weight}" fill="#{fill}">#{escape(content)}</text>)
    end

    def escape(content)
      content.to_s.gsub("&", "&amp;").gsub("<", "&lt;").gsub(">", "&gt;").gsub('"', "&quot;")
    end

    # "2360", "19.5", "0.42", "10": integers from 100 up and whole numbers as
    # they are, else three significant digits.
    def self.format_number(value)
      return value.round.to_s if value.abs >= 100 || value == value.round

      format("%.#{[2 - Math.log10(value.abs).floor, 0].max}f", value)
    end

    # Maps values to pixel heights, linear from 0 or logarithmic by decades.
    class Scale
      def initialize(values, log:)
        @log = log
        positive = values.select(&:positive?)
        if log
          @low = 10.0**Math.log10(positive.min || 1).floor
          @high = 10.0**Math.log10(positive.max || 10).ceil
          @high *= 10 if @high <= @low
        else
          @low = 0.0
          @step = nice_step((values.max || 1).to_f / 5)
          @high = [(values.max.to_f / @step).ceil, 1].max * @step
        end
      end

      # @return [Array<Float>] values that get a grid line and a label
      def ticks
        if @log
          (Math.log10(@low).round..Math.log10(@high).round).map { |power| 10.0**power }
        else
          (0..(@high / @step).round).map { |i| i * @step }
        end
      end

      # @return [Float] the pixel row for `value` between bottom and top
      def y(value, bottom, top)
        fraction =
          if @log
            value <= 0 ? 0.0 : (Math.log10(value) - Math.log10(@low)) / (Math.log10(@high) - Math.log10(@low))
          else
            value / @high
          end
        bottom - (fraction.clamp(0.0, 1.0) * (bottom - top))
      end

      private

      def nice_step(rough)
        return 1.0 if rough <= 0

        magnitude = 10.0**Math.log10(rough).floor
        [1, 2, 2.5, 5, 10].map { |m| m * magnitude }.find { |step| step >= rough }
      end
    end
  end
end
